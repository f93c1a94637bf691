"""Exchange schedules with other libraries. No torch import here: the formats are text."""
from .torch_comms import (
    program_from_torch_csv,
    program_from_torch_rows,
    program_to_torch_csv,
    program_to_torch_rows,
)
from .torch_pipelining import (
    from_torch_csv,
    from_torch_rows,
    to_torch_csv,
    to_torch_rows,
)

__all__ = [
    "to_torch_csv", "from_torch_csv", "to_torch_rows", "from_torch_rows", "program_to_torch_csv",
    "program_from_torch_csv", "program_to_torch_rows", "program_from_torch_rows",
]
