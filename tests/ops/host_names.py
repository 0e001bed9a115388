"""The [[host_name]]s of a kernels_metal/ library, for the tests that run
every kernel variant at least once."""

import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


@lru_cache(maxsize=None)
def host_names(library: str) -> frozenset[str]:
    from mps_ext_executor import _compiler, _translate
    from tools.embed_shaders import flatten

    pre = _compiler.preprocess(flatten(ROOT / "kernels_metal" / f"{library}.metal"), f"{library}.metal", None)
    # A host name built by macros is adjacent string literals: "a" "b".
    return frozenset(re.sub(r'"\s*"', "", k.host_name) for k in _translate.translate(pre).kernels)
