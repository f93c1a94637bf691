"""The Schedule: per rank, an ordered list of compute actions, plus placement and sizes.

Text form (`Schedule.to_text`), one line per rank after a header::

    # pipeblocks schedule 1f1b p=2 m=3 placement=loop stages=2
    0: 0F0 0F1 0BW0 0F2 0BW1 0BW2
    1: 1F0 1BW0 1F1 1BW1 1F2 1BW2

A forward written `0F3&3BW1` is overlapped with the fused backward after it: the pair runs
as one op (`Schedule.overlapped` holds its forward; DualPipe's F&B chunk pair)::

    # pipeblocks schedule dualpipev p=2 m=4 placement=v stages=0,1,1,0
    0: 0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3&3BW1 3F2&0BW0 ...

A schedule of several chains (`chains=2` in the header: DualPipe's two directions) runs
independent pipelines over consecutive groups of stages, each on its own share of the
microbatches: with S stages and m microbatches, chain c is stages c*S/chains .. and
microbatches c*m/chains ..; a stage that starts a chain takes the input, one that ends it
computes the loss.

`Schedule.from_text(s.to_text()) == s`, and JSON (`to_json`/`from_json`, `save`/`load`)
round-trips too. A schedule says only the order on each rank; times come from the
simulator.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .actions import Action, parse_actions
from .errors import ScheduleError
from .placement import Placement

__all__ = ["Schedule", "read_text_file", "stage_owners", "write_atomically"]

_FORMAT = "pipeblocks-schedule/1"


@dataclass(frozen=True)
class Schedule:
    """A complete pipeline schedule.

    name: the generator (or "custom").
    p: pipeline ranks.  m: microbatches per step.  seq_chunks: sequence chunks per microbatch.
    placement: which rank runs each global stage.
    ranks: `ranks[r]` is rank r's actions in execution order.
    options: the generator options that built it, for display and reproduction.
    overlapped: the forwards that run overlapped with the fused backward right after them
        on their rank, as one op (`program.Overlap`); empty for most schedules.
    chains: independent pipelines over equal consecutive groups of stages and of
        microbatches (1 for every schedule but DualPipe, whose two directions are 2).
    """

    name: str
    p: int
    m: int
    placement: Placement
    ranks: tuple[tuple[Action, ...], ...]
    seq_chunks: int = 1
    options: tuple[tuple[str, object], ...] = field(default=())
    overlapped: frozenset[Action] = field(default=frozenset())
    chains: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.chains, int) or self.chains < 1 or self.placement.num_stages % self.chains or (
                self.m % self.chains):
            raise ScheduleError(
                f"schedule {self.name!r}: chains={self.chains!r} must divide the stages "
                f"({self.placement.num_stages}) and the microbatches (m={self.m})"
            )
        for label, value in (("p", self.p), ("m", self.m), ("seq_chunks", self.seq_chunks)):
            if not isinstance(value, int) or value < 1:
                raise ScheduleError(f"schedule {self.name!r}: {label} must be an integer >= 1, got {value!r}")
        if self.placement.num_ranks != self.p:
            raise ScheduleError(
                f"schedule {self.name!r}: placement covers {self.placement.num_ranks} ranks but p={self.p}"
            )
        if len(self.ranks) != self.p:
            raise ScheduleError(f"schedule {self.name!r}: {len(self.ranks)} rank programs given for p={self.p}")

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    @property
    def chain_length(self) -> int | None:
        """Stages per chain, or None for a schedule of one chain (`deps.requirements`)."""
        return self.num_stages // self.chains if self.chains > 1 else None

    def chain_of_stage(self, stage: int) -> int:
        return stage * self.chains // self.num_stages

    def chain_of_microbatch(self, microbatch: int) -> int:
        return microbatch * self.chains // self.m

    def starts_chain(self, stage: int) -> bool:
        """The stage takes the step's input (stage 0, or the first of its chain)."""
        return stage % (self.num_stages // self.chains) == 0

    def ends_chain(self, stage: int) -> bool:
        """The stage computes the loss (the last stage, or the last of its chain)."""
        return (stage + 1) % (self.num_stages // self.chains) == 0

    @property
    def v(self) -> int:
        """Stages (chunks) per rank."""
        return self.placement.stages_per_rank

    @property
    def has_split_backward(self) -> bool:
        return any(a.kind.value == "W" for actions in self.ranks for a in actions)

    def option(self, key: str, default: object = None) -> object:
        return dict(self.options).get(key, default)

    # ---- text form ------------------------------------------------------------
    def to_text(self) -> str:
        header = (
            f"# pipeblocks schedule {self.name} p={self.p} m={self.m} placement={self.placement.shape} "
            f"stages={','.join(map(str, self.placement.stage_to_rank))}"
        )
        if self.seq_chunks != 1:
            header += f" seq_chunks={self.seq_chunks}"
        if self.chains != 1:
            header += f" chains={self.chains}"
        lines = [header] + [f"{r}: " + self._row(acts) for r, acts in enumerate(self.ranks)]
        return "\n".join(lines) + "\n"

    def _row(self, actions: tuple[Action, ...]) -> str:
        """One rank's actions as text, an overlapped pair as `F&BW`."""
        if not self.overlapped:
            return " ".join(map(str, actions))
        return " ".join(f"{a}&" if a in self.overlapped else f"{a}" for a in actions).replace("& ", "&")

    @staticmethod
    def from_text(text: str) -> Schedule:
        header: dict[str, str] = {}
        overlapped: set[Action] = set()
        name = "custom"
        rows: dict[int, tuple[Action, ...]] = {}
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line:
                continue
            if line.startswith("#"):
                words = line.lstrip("#").split()
                if words[:2] == ["pipeblocks", "schedule"] and len(words) > 2:
                    name = words[2]
                    header.update(w.split("=", 1) for w in words[3:] if "=" in w)
                continue
            rank_text, sep, body = line.partition(":")
            if not sep or not rank_text.strip().isdigit():
                raise ScheduleError(f"schedule text line {lineno}: expected '<rank>: <actions>', got {raw!r}")
            rank = int(rank_text)
            if rank in rows:
                raise ScheduleError(f"schedule text line {lineno}: rank {rank} is listed twice")
            rows[rank] = _parse_row(body, overlapped)
        if not rows:
            raise ScheduleError("schedule text has no rank lines: expected lines like '0: 0F0 0F1 0BW0 ...'")
        p = max(rows) + 1
        missing = [r for r in range(p) if r not in rows]
        if missing:
            raise ScheduleError(f"schedule text lacks rank(s) {missing} (ranks 0..{p - 1} must all appear)")
        ranks = tuple(rows[r] for r in range(p))
        placement = _placement_from_header(header, ranks, p)
        m = _header_int(header, "m", header["m"]) if "m" in header else 1 + max(
            a.microbatch for acts in ranks for a in acts)
        seq = (_header_int(header, "seq_chunks", header["seq_chunks"]) if "seq_chunks" in header else 0) or 1 + max(
            (a.seq_chunk or 0) for acts in ranks for a in acts)
        chains = _header_int(header, "chains", header["chains"]) if "chains" in header else 1
        return Schedule(name, p, m, placement, ranks, seq_chunks=seq, overlapped=frozenset(overlapped), chains=chains)

    # ---- JSON -----------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": _FORMAT,
            "name": self.name,
            "p": self.p,
            "m": self.m,
            "seq_chunks": self.seq_chunks,
            **({"chains": self.chains} if self.chains != 1 else {}),
            "placement": self.placement.to_json(),
            "options": {k: v for k, v in self.options},
            "ranks": [self._row(acts) for acts in self.ranks],
        }

    @staticmethod
    def from_json(data: dict) -> Schedule:
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ScheduleError(f"not a pipeblocks schedule: expected a JSON object with \"format\": \"{_FORMAT}\"")
        missing = [key for key in ("name", "p", "m", "placement", "ranks") if key not in data]
        if missing:
            raise ScheduleError(f"malformed schedule JSON: missing field(s) {', '.join(map(repr, missing))}")
        name, ranks, options = data["name"], data["ranks"], data.get("options", {})
        if not isinstance(name, str):
            raise ScheduleError(f"malformed schedule JSON: \"name\" must be a string, got {name!r}")
        if not isinstance(ranks, list) or not all(isinstance(row, str) for row in ranks):
            raise ScheduleError(
                "malformed schedule JSON: \"ranks\" must be a list of strings, one per rank, such as "
                f"\"0F0 0F1 0BW0\"; got {ranks!r}"
            )
        if not isinstance(options, dict):
            raise ScheduleError(f"malformed schedule JSON: \"options\" must be an object, got {options!r}")
        overlapped: set[Action] = set()
        rows = tuple(_parse_row(row, overlapped) for row in ranks)
        return Schedule(
            name=name,
            p=_whole(data, "p"),
            m=_whole(data, "m"),
            seq_chunks=_whole(data, "seq_chunks", 1),
            placement=Placement.from_json(data["placement"]),
            ranks=rows,
            options=tuple(sorted(options.items())),
            overlapped=frozenset(overlapped),
            chains=_whole(data, "chains", 1),
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write JSON (`.json`) or the text form (any other suffix), atomically."""
        path = Path(path)
        body = json.dumps(self.to_json(), indent=1) if path.suffix.lower() == ".json" else self.to_text()
        write_atomically(path, body)

    @staticmethod
    def load(path: str | os.PathLike) -> Schedule:
        path = Path(path)
        text = read_text_file(path, "schedule file")
        if path.suffix.lower() == ".json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as err:
                raise ScheduleError(f"schedule file {str(path)!r} is not valid JSON: {err}") from None
            return Schedule.from_json(data)
        return Schedule.from_text(text)


def _parse_row(text: str, overlapped: set[Action]) -> tuple[Action, ...]:
    """A rank's actions; `F&BW` adds both and marks the forward overlapped."""
    if "&" not in text:
        return parse_actions(text)
    actions: list[Action] = []
    for token in text.split():
        parts = token.split("&")
        if len(parts) > 2 or (len(parts) == 2 and not all(parts)):
            raise ScheduleError(f"cannot parse {token!r}: an overlapped pair is two actions, <F>&<BW>, e.g. 0F3&3BW1")
        pair = [Action.parse(part) for part in parts]
        if len(pair) == 2:
            overlapped.add(pair[0])
        actions.extend(pair)
    return tuple(actions)


def _whole(data: dict, key: str, default: int | None = None) -> int:
    value = data.get(key, default)
    # bool is an int subclass, and int(2.7) would truncate silently: both are errors
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScheduleError(f"malformed schedule JSON: {key!r} must be a whole number, got {value!r}")
    return value


def _header_int(header: dict[str, str], key: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ScheduleError(f"schedule header {key}={header[key]}: expected whole numbers, e.g. {key}=4") from None


def _placement_from_header(header: dict[str, str], ranks: tuple[tuple[Action, ...], ...], p: int) -> Placement:
    if "stages" in header:
        owners = tuple(_header_int(header, "stages", r) for r in header["stages"].split(","))
        return Placement(owners, header.get("placement", "explicit"))
    return Placement(stage_owners(ranks, hint="add a 'stages=' header to state the placement"))


def stage_owners(ranks, *, num_stages: int | None = None, hint: str = "") -> tuple[int, ...]:
    """`owners[s]` is the rank whose list runs stage s, inferred from per-rank action lists;
    an error when a stage appears on two ranks or a stage in 0..S-1 has no action."""
    owner: dict[int, int] = {}
    for rank, actions in enumerate(ranks):
        for action in actions:
            if owner.setdefault(action.stage, rank) != rank:
                raise ScheduleError(
                    f"stage {action.stage} appears on ranks {owner[action.stage]} and {rank}: "
                    f"a stage must live on one rank{' (' + hint + ')' if hint else ''}"
                )
    count = num_stages if num_stages is not None else len(owner)
    missing = [s for s in range(count) if s not in owner]
    if missing or len(owner) != count:
        raise ScheduleError(
            f"stages {missing or sorted(owner)} do not match stages 0..{count - 1}: every stage must appear, "
            "numbered from 0"
        )
    return tuple(owner[s] for s in range(count))


def read_text_file(path: str | os.PathLike, what: str) -> str:
    """A text file as written by hand or by other tools: UTF-8 with or without a byte-order
    mark, any line ends (universal newlines turn CRLF into LF)."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except OSError as err:
        raise ScheduleError(f"cannot read {what} {str(path)!r}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise ScheduleError(
            f"{what} {str(path)!r} is not UTF-8 text (byte {err.start}: {err.reason}): save it as UTF-8"
        ) from None


def write_atomically(path: Path, body: str) -> None:
    """Write to a temporary file beside `path`, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(body)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
