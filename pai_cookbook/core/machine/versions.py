"""Which Megatron-Core and torch the cookbook runs on, decided once, when `pai_cookbook` is imported.

The range is the one pyproject.toml declares (a test holds the two together): 0.16 is the newest release for Python
3.11, 0.19 what Python 3.12 GPU images of late 2026 carry; CI tests both ends (docs/installing.md). The check reads
installed metadata only (no import of torch or Megatron-Core, a second or more each), so importing the package stays
cheap; a version outside the range is refused with the range and the fix, before any worker starts.
"""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

MEGATRON_CORE = SpecifierSet(">=0.16.1,<0.20")
"""The Megatron-Core releases the cookbook is tested on (pyproject.toml's dependency)."""
TORCH = SpecifierSet(">=2.11.0a0")
"""torch's floor ("a0": NGC's pre-release builds of 2.11); no ceiling, so a GPU image's CUDA build is never replaced."""
TESTED = {"0.16": "0.16.1 on Python 3.11 (torch 2.13.0+cpu)", "0.19": "0.19.2 on Python 3.12 (torch 2.13.0+cu130)"}
"""The two ends CI runs, by minor release: ci/constraints.txt and ci/constraints-mcore016.txt pin them."""


def megatron_core_version() -> Version | None:
    """The installed Megatron-Core's version (from its metadata), or None where it is not installed."""
    try:
        return Version(metadata.version("megatron-core"))
    except metadata.PackageNotFoundError:
        return None


def minor(version: Version | str | None = None) -> tuple[int, int]:
    """(major, minor) of `version`, by default the installed Megatron-Core's: what compatibility decisions key on."""
    version = Version(str(version)) if version is not None else megatron_core_version()
    if version is None:
        raise RuntimeError("megatron-core is not installed: pip install 'megatron-core" + str(MEGATRON_CORE) + "'")
    return version.major, version.minor


def check(megatron_core: str | None = None, torch: str | None = None) -> None:
    """Refuse a Megatron-Core or torch outside the tested range (each read from its metadata unless given).

    Raises:
        RuntimeError: naming what is installed, the range, and how to install a version inside it.
    """
    found = {"megatron-core": megatron_core, "torch": torch}
    for name, spec in (("megatron-core", MEGATRON_CORE), ("torch", TORCH)):
        version = found[name]
        if version is None:
            try:
                version = metadata.version(name)
            except metadata.PackageNotFoundError:
                continue  # pip installs it with the cookbook; a bare checkout fails later with ImportError's words
        if not spec.contains(Version(version), prereleases=True):
            raise RuntimeError(
                f"{name} {version} is installed, but the cookbook is tested on {name}{spec}. Install a version "
                f"inside that range (pip install '{name}{spec}'; bash ci/setup_env.sh sets up CI's exact versions) "
                f"or check out the cookbook release that supports {version}.")


def common_state_in_shards(version: Version | str | None = None) -> bool:
    """Whether Megatron-Core's `dist_checkpointing.save` keeps a checkpoint's common (non-sharded) state inside the
    torch_dist files (0.19 on) rather than in `common.pt` beside them (0.16 to 0.18, which read only that). The
    cookbook's saves write `common.pt` too where this holds (`core.checkpoints.checkpoint`), so 0.16 loads what 0.19 saved."""
    return minor(version) >= (0, 19)


def inference_wrapper_takes_config(version: Version | str | None = None) -> bool:
    """Whether Megatron-Core's inference wrappers take an `InferenceWrapperConfig` beside the context (0.16); 0.17
    removed it, and a wrapper reads the model's own config (`workers.engine.build_engine`)."""
    return minor(version) < (0, 17)
