"""The ``show`` command: JSON for object entries and without values; with ``--json``, stdout is that JSON alone."""

from __future__ import annotations

import json

from conftest import run_cli


def test_show_json_for_objects_and_without_values(fixtures):
    obj = run_cli("show", fixtures["fsdp2_r2"], "extra.ints", "--json")
    assert obj.returncode == 0, obj.stderr
    rec = json.loads(obj.stdout)["object"]  # stdout is the JSON document alone (issue 29, item 10)
    assert rec["fqn"] == "extra.ints" and rec["type"] == "list" and rec["value"] == "[1, 2]" and rec["length"] > 0
    bare = run_cli("show", fixtures["fsdp2_r2"], "model.emb.weight", "--json", "--no-values")
    assert bare.returncode == 0, bare.stderr
    rec = json.loads(bare.stdout)
    assert rec["stats"] is None and rec["tensor"]["shape"] == [37, 12]


def test_show_json_of_a_tensor_with_values_is_json_alone(fixtures):
    proc = run_cli("show", fixtures["fsdp2_r2"], "model.emb.weight", "--json")
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(proc.stdout)
    assert rec["tensor"]["shape"] == [37, 12] and rec["stats"]["numel"] == 37 * 12
    text = run_cli("show", fixtures["fsdp2_r2"], "model.emb.weight")
    assert text.returncode == 0 and "min " in text.stdout and "{" not in text.stdout, text.stdout
