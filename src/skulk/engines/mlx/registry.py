"""mlx-lm's model registry, read in the MLX probe's child interpreter (`python -m skulk.engines.mlx.registry`).

mlx-lm loads a config by importing `mlx_lm.models.<type>` after its own remapping (mlx_lm.utils._get_classes),
and needs the module's `Model` and `ModelArgs`. This child checks that MLX computes here (the probe), then prints
that registry as JSON: the model modules mlx-lm ships (those defining or re-exporting both names; its helper
modules, such as `cache` or `switch_layers`, define neither), its remappings, and how each module can be split:
Tensor where its Model has mlx-lm's `shard(group)`, and which modules build their decoder stack on mlx-lm's
`PipelineMixin` (a stack that re-derives its per-layer indices when its layers are cut; engines/mlx/ring.py).
The node reads it into models/families.MlxRegistry without importing MLX itself.
"""

from __future__ import annotations

import json
import pkgutil
import re
from pathlib import Path
from typing import Any

_NAMES = [re.compile(rf"^(class {name}\b|from \S+ import .*\b{name}\b)", re.MULTILINE)
          for name in ("Model", "ModelArgs")]
_SHARDS = re.compile(r"^    def shard\(self\b", re.MULTILINE)
_PIPELINE = re.compile(r"^class \w+\([^)]*\bPipelineMixin\b", re.MULTILINE)


def is_model_module(source: str) -> bool:
    """The module gives mlx-lm's loader what it takes from it: a top-level `Model` and `ModelArgs`."""
    return all(pattern.search(source) for pattern in _NAMES)


def splits_of(source: str) -> dict[str, bool]:
    """What a model module's source offers for a split: `tensor` (a class method `shard(self, group)`, as
    mlx-lm's sharded models define on Model) and `pipeline` (a decoder stack on PipelineMixin)."""
    return {"tensor": bool(_SHARDS.search(source)), "pipeline": bool(_PIPELINE.search(source))}


def collect() -> dict[str, Any]:
    import mlx.core as mx
    import mlx_lm
    import mlx_lm.models
    import mlx_lm.utils

    mx.eval(mx.array([1.0]) + 1)
    root = Path(next(iter(mlx_lm.models.__path__)))
    sources = {m.name: (root / f"{m.name}.py").read_text(errors="replace")
               for m in pkgutil.iter_modules([str(root)]) if not m.ispkg}
    modules = sorted(name for name, source in sources.items() if is_model_module(source))
    splits = {name: splits_of(sources[name]) for name in modules}
    arch = getattr(mlx_lm.utils, "MODEL_ARCHITECTURE_REMAPPING", {})
    return {
        "version": getattr(mlx_lm, "__version__", "?"),
        "modules": modules,
        "remapping": dict(getattr(mlx_lm.utils, "MODEL_REMAPPING", {})),
        "architecture_remapping": [[t, a, m] for (t, a), m in arch.items()],
        "tensor": [name for name in modules if splits[name]["tensor"]],
        "pipeline": [name for name in modules if splits[name]["pipeline"]],
    }


if __name__ == "__main__":
    print(json.dumps(collect()))
