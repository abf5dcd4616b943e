"""The export plan (backend/export/planner.py): --only/--exclude/--rename/--strip-prefix errors, and the plan is
not mutated."""

from __future__ import annotations

import pytest
from shardscope.backend.export import ExportError, export, plan_export
from shardscope.backend.formats import open_checkpoint


def test_exclude_and_prefix_errors_and_plan_is_not_mutated(fixtures, tmp_path):
    ckpt = open_checkpoint(fixtures["fsdp2_r2"])
    plan = plan_export(ckpt, "safetensors", exclude=["model.head"])
    assert all(not it.entry.fqn.startswith("model.head") for it in plan.items)
    assert any("under model.head, left out as asked" in n for n in plan.left_out)
    with pytest.raises(ExportError, match=r"model\.nosuch \(a prefix to leave out\) matches no entry"):
        plan_export(ckpt, "safetensors", exclude=["model.nosuch"])
    with pytest.raises(ExportError, match="rename rule 'no-equals-sign': write it as REGEX=REPLACEMENT"):
        plan_export(ckpt, "safetensors", rename=["no-equals-sign"])
    before = (plan.items, plan.left_out)
    export(plan, str(tmp_path / "a.safetensors"))
    assert (plan.items, plan.left_out) == before
