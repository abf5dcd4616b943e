"""The ``show`` command: JSON for object entries and without values."""

from __future__ import annotations

import json

from conftest import run_cli


def test_show_json_for_objects_and_without_values(fixtures):
    obj = run_cli("show", fixtures["fsdp2_r2"], "extra.ints", "--json")
    assert obj.returncode == 0, obj.stderr
    rec = json.loads(obj.stdout.splitlines()[-1])["object"]
    assert rec["fqn"] == "extra.ints" and rec["type"] == "list" and rec["value"] == "[1, 2]" and rec["length"] > 0
    bare = run_cli("show", fixtures["fsdp2_r2"], "model.emb.weight", "--json", "--no-values")
    assert bare.returncode == 0, bare.stderr
    rec = json.loads(bare.stdout.splitlines()[-1])
    assert rec["stats"] is None and rec["tensor"]["shape"] == [37, 12]
