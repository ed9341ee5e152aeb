"""A training checkpoint whose files are missing or cut short (a disk that filled after the save, a copy cut short),
found from its metadata and file sizes before a resume loads it, and set aside (kept, never loaded again)."""

from __future__ import annotations

from pathlib import Path

from pai_cookbook.core.checkpoints import checkpoint

DAMAGED_SUFFIX = ".damaged"


def damage(ckpt: str | Path) -> str | None:
    """What a checkpoint's files lack (a file its metadata lists is missing or shorter than the tensors it must
    hold: a disk that filled, a copy cut short), or None when every stored item is there in full. Reads the
    metadata and the files' sizes only."""
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = Path(ckpt)
    try:
        storage = FileSystemReader(str(ckpt)).read_metadata().storage_data.values()
    except Exception as err:  # noqa: BLE001 - any unreadable metadata is damage, named with its cause
        return f"its metadata (.metadata) cannot be read: {type(err).__name__}: {err}"
    needed: dict[str, int] = {}
    for info in storage:
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = ckpt / name
        if not path.exists():
            return f"{name} is missing"
        if path.stat().st_size < size:
            return f"{name} is {path.stat().st_size} bytes, its tensors need {size}"
    return None


def set_damaged_aside(save_dir: str | Path) -> list[str]:
    """Rename damaged latest checkpoints to `<iter>.damaged` (kept, never loaded) until the latest is whole, so a
    resume starts from the last complete one instead of failing in every worker; what was done, one line each."""
    said = []
    for latest in reversed(checkpoint.finished_iterations(save_dir)):
        problem = damage(latest)
        if problem is None:
            break
        aside = set_aside(latest, DAMAGED_SUFFIX)
        said.append(f"{latest.name} is damaged ({problem}): set aside as {aside.name}, kept for you to inspect")
    return said


def set_aside(ckpt: Path, suffix: str) -> Path:
    """Rename a checkpoint folder to `<name><suffix>` (numbered when taken): kept, never listed or loaded."""
    aside, n = ckpt.with_name(ckpt.name + suffix), 1
    while aside.exists():
        aside, n = ckpt.with_name(f"{ckpt.name}{suffix}{n}"), n + 1
    ckpt.rename(aside)
    return aside
