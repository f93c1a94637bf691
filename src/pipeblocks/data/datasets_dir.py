"""A Hugging Face dataset saved with `Dataset.save_to_disk`, read locally as documents.

    >>> is_dataset_dir("corpus/")                     # True: it holds dataset_info.json or state.json
    >>> for texts, done in dataset_documents(Path("corpus/"), "text", 1024): ...

Needs the `datasets` library only when such a directory is given (pip install datasets);
`load_from_disk` reads the Arrow files memory-mapped, and rows are taken a batch at a time.
A saved DatasetDict (several splits) is refused with the directory of one split to give.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

__all__ = ["DATASET_MARKERS", "dataset_documents", "is_dataset_dir"]

DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
"""files `save_to_disk` writes at the top of the directory (the last for a DatasetDict)"""


def is_dataset_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in DATASET_MARKERS)


def dataset_documents(source: Path, field: str, batch: int) -> Iterator[tuple[list[str], int]]:
    """(texts of `batch` rows, rows read so far as the progress measure)."""
    dataset = _load(source)
    if field not in dataset.column_names:
        raise ValueError(f"dataset {str(source)!r} has no field {field!r} (it has {', '.join(dataset.column_names)}): "
                         f"--data-field chooses the field that holds the text")
    rows = len(dataset)
    if rows == 0:
        raise ValueError(f"dataset {str(source)!r} has no rows: give a dataset with some text to --data")
    return _batches(dataset, source, field, batch, rows)


def _batches(dataset, source: Path, field: str, batch: int, rows: int) -> Iterator[tuple[list[str], int]]:
    size = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    for start in range(0, rows, batch):
        texts = dataset[start:start + batch][field]
        for row, text in enumerate(texts, start):
            if not isinstance(text, str):
                raise ValueError(f"row {row} of dataset {str(source)!r}: field {field!r} is a {type(text).__name__}, "
                                 f"not text: --data-field chooses the field that holds the text")
        # progress is in bytes of the directory, as for files: the share of rows read
        yield texts, size * min(rows, start + batch) // rows


def _load(source: Path):
    try:
        import datasets  # optional (the datasets extra), and heavy
    except ImportError:
        raise ValueError(f"{str(source)!r} is a saved Hugging Face dataset; reading it needs the datasets library: "
                         f"pip install datasets") from None
    if (source / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in source.iterdir() if p.is_dir())
        example = source / (splits[0] if splits else "train")
        raise ValueError(f"{str(source)!r} is a saved DatasetDict of several splits ({', '.join(splits)}): give one "
                         f"split's directory to --data, e.g. {str(example)!r}")
    try:
        dataset = datasets.load_from_disk(str(source))
    except Exception as err:  # the library raises several kinds for a damaged or foreign directory
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"cannot read the saved dataset {str(source)!r}: {why}") from None
    if not isinstance(dataset, datasets.Dataset):
        raise ValueError(f"{str(source)!r} holds a {type(dataset).__name__}, not one Dataset: give the directory "
                         f"of one split")
    return dataset
