"""Which export is a checkpoint's, for ``watch``: the first key parts its export selects (the layout rules
``export`` uses), and whether an export made elsewhere (the Export dialog, at the path a watch writes) is this very
checkpoint's (:func:`.watch_record.made_from`) and holds every tensor a watch's export would."""

from __future__ import annotations

from typing import Any

from ..errors import ShardscopeError
from ..export import ExportPlan
from ..export.layouts import recognise_layout
from ..formats import open_checkpoint
from ..text import count


def model_prefixes(ckpt: Any) -> list[str]:
    """The first key parts (below a wrapper key) that hold the model's weights, as ``export``'s layout rules judge
    them: what a torch export of a watch selects, so that it is weights (a safetensors export selects them itself)
    and never counts as resumable training state."""
    layout = recognise_layout(ckpt)
    return sorted({layout.root_key(t.fqn) for t in ckpt.tensors if layout.keeps_tensor(t.fqn)}
                  | {layout.root_key(o.fqn) for o in ckpt.objects if layout.is_model(o.fqn)})


def holds_the_plan(export_path: str, plan: ExportPlan) -> str:
    """Why the export at ``export_path`` is not what ``plan`` writes (its tensors' names, dtypes and shapes), or
    ''; an export that left out a weight is never taken for the checkpoint's."""
    try:
        made = {t.fqn: (t.dtype, tuple(t.shape)) for t in open_checkpoint(export_path, use_cache=False).tensors}
    except (ShardscopeError, OSError) as exc:
        return f"cannot read it ({exc})"
    wanted = {it.key: (it.dtype, it.shape) for it in plan.items}  # the output shape (a transform changes it)
    missing = sorted(set(wanted) - set(made))
    if missing:
        return f"it lacks {count(len(missing), 'tensor')} of the model ({', '.join(missing[:3])})"
    other = sorted(k for k in made if wanted.get(k) != made[k])
    return f"its tensors differ from the model's ({', '.join(other[:3])})" if other else ""


__all__ = ["holds_the_plan", "model_prefixes"]
