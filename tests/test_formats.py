"""backend/formats: the one door. Every format's detect and probe, the registry's order, every command over every
kind of path the window opens, a torch file's values through the one chunk reader (its records' CRC32 checked),
the Hugging Face cache's links, and the rules that keep the door the only one (no format name compared and no
file-name rule spelled outside ``formats``/``filenames``)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cli_in_process as cli
from safetensors.torch import save_file
from shardscope.backend import formats
from shardscope.backend.checkpoint.chunks import ChunkReader, CorruptChunkError
from shardscope.backend.formats import detect_file, detect_folder, format_named, open_checkpoint, resolve

ROOT = Path(__file__).resolve().parent.parent


def _model_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    emb = torch.randn(11, 6)
    return {"embed.weight": emb, "head.weight": emb, "block.0.weight": torch.randn(6, 6),
            "block.0.bias": torch.randn(6), "norm.scale": torch.ones(6)}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    """One checkpoint of each single-file and HF kind, written by the libraries' own save functions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("formats")
    out: dict[str, Path] = {}
    state = _model_state()
    model = torch.nn.Linear(6, 6)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    out["pt"] = root / "model.pt"
    torch.save(state, out["pt"])  # tied weights: embed and head share one storage
    out["ckpt"] = root / "epoch=1-step=20.ckpt"
    torch.save({"state_dict": {k: v.clone() for k, v in state.items() if k != "head.weight"},
                "optimizer_states": [opt.state_dict()], "global_step": 20}, out["ckpt"])
    out["safetensors"] = root / "model.safetensors"
    save_file({k: v.clone().contiguous() for k, v in state.items()}, out["safetensors"])
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(1)
    hf = root / "hf"
    LlamaForCausalLM(cfg).save_pretrained(hf, max_shard_size="20KB", safe_serialization=True)
    assert (hf / "model.safetensors.index.json").exists()
    out["hf_folder"] = hf
    out["hf_index_file"] = hf / "model.safetensors.index.json"
    return out


@pytest.mark.parametrize("kind", ["pt", "ckpt", "safetensors", "hf_folder", "hf_index_file", "dcp", "metadata"])
def test_every_command_takes_every_path_the_window_opens(capsys, tmp_path, paths, fixtures, kind):
    """inspect, verify (plain and deep), show, export, diff, import and reshard all take the path, as the window
    (load_any) does; an export of it equals what the window shows."""
    from shardscope.backend.compare.browse_file import load_any

    path = {"dcp": fixtures["fsdp2_r2"], "metadata": fixtures["fsdp2_r2"] / ".metadata"}.get(kind) or paths[kind]
    data = load_any(str(path))
    assert data.ckpt.tensors
    fqn = data.ckpt.tensors[0].fqn
    for args in (("inspect", path), ("verify", path), ("verify", "--deep", path), ("show", path, fqn),
                 ("diff", path, path)):
        rc, out, err = cli(capsys, *args)
        assert rc == 0, (args, out, err)
    rc, out, err = cli(capsys, "export", path, tmp_path / "out.safetensors")
    assert rc == 0 and "verified" in out, (out, err)
    rc, out, err = cli(capsys, "import", path, tmp_path / "dcp")
    assert rc == 0, (out, err)
    rc, out, err = cli(capsys, "reshard", path, tmp_path / "dcp3", "--ranks", "3")
    assert rc == 0, (out, err)
    with ChunkReader(data.ckpt) as a, ChunkReader(open_checkpoint(tmp_path / "dcp3")) as b:
        for t in data.ckpt.tensors:
            assert torch.equal(a.read_tensor(t), b.read_tensor(b.ckpt.tensor(t.fqn))), t.fqn


def test_registry_order_and_detection(fixtures, paths):
    names = [f.name for f in formats.FORMATS]
    assert len(names) == len(set(names))
    assert all(f.label and f.kind in (formats.RESUMABLE, formats.WEIGHTS) for f in formats.FORMATS)
    listing = dict.fromkeys(os.listdir(fixtures["lightning_r2"]))
    assert detect_folder("ck", listing, []).name == "lightning"  # a Lightning folder is also a DCP folder
    assert detect_folder("ck", set(os.listdir(fixtures["fsdp2_r2"])), []).name == "dcp"
    assert detect_folder("ck", set(os.listdir(fixtures["hf_r2"])), []).name == "hf-safetensors"
    assert detect_folder("checkpoint-500", {"trainer_state.json", "model.safetensors"}, []).name == "hf-trainer"
    assert detect_folder("hf", set(os.listdir(paths["hf_folder"])), []).name == "hf-sharded"
    assert detect_folder("notes", {"README.md"}, ["src"]) is None
    assert detect_file("model.safetensors").name == "safetensors"
    assert {detect_file(n).name for n in ("a.pt", "a.pth", "pytorch_model.bin", "last.ckpt")} == {"torch"}
    assert detect_file(".model.safetensors.tmp") is None and detect_file("notes.txt") is None
    assert resolve(paths["hf_index_file"])[0].name == "hf-sharded"  # an index file opens its folder
    assert resolve(fixtures["fsdp2_r2"] / ".metadata")[0].name == "dcp"
    assert format_named("dcp-safetensors").name == "dcp"  # a listing's variant belongs to its format


def test_detect_and_probe_import_neither_numpy_nor_torch(fixtures, paths):
    """`ls` decides with names and a few header bytes: the formats' detect and probe pull in no numpy or torch."""
    code = (
        "import sys, os\n"
        "from shardscope.backend.formats import detect_folder, detect_file\n"
        f"d = {str(fixtures['fsdp2_r2'])!r}\n"
        "names = set(os.listdir(d))\n"
        "f = detect_folder('step', names, [])\n"
        "facts = f.probe_folder(d, names, [])\n"
        f"t = detect_file('model.pt').probe_file({str(paths['pt'])!r}, os.path.getsize({str(paths['pt'])!r}))\n"
        f"s = {str(paths['safetensors'])!r}\n"
        "st = detect_file('model.safetensors').probe_file(s, os.path.getsize(s))\n"
        "print(facts.state, facts.kind, t.state, t.kind, st.state, st.kind)\n"
        "assert 'numpy' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["complete", "resumable", "complete", "weights", "complete", "weights"]


def test_torch_file_values_go_through_the_chunk_reader(capsys, tmp_path, paths):
    """A torch file's tensors are read from their records with the stored CRC32 checked: a flipped byte in a
    record is a named CRC failure for show, deep verify and export (never silently wrong values); tied weights
    share a record and are healthy."""
    pt = tmp_path / "model.pt"
    pt.write_bytes(paths["pt"].read_bytes())
    ckpt = open_checkpoint(pt)
    assert ckpt.located and ckpt.problems == []
    state = _model_state()
    with ChunkReader(ckpt) as reader:
        for k, v in state.items():
            assert torch.equal(reader.read_tensor(ckpt.tensor(k)), v), k
    assert cli(capsys, "verify", "--deep", pt)[0] == 0
    chunk = ckpt.tensor("block.0.weight").chunks[0]
    data = bytearray(pt.read_bytes())
    data[chunk.offset + 5] ^= 0xFF
    pt.write_bytes(bytes(data))
    with ChunkReader(open_checkpoint(pt)) as reader, pytest.raises(CorruptChunkError, match="CRC32"):
        reader.read_tensor(reader.ckpt.tensor("block.0.weight"))
    rc, out, err = cli(capsys, "verify", "--deep", pt)
    assert rc == 1 and "[corrupt]" in out and "block.0.weight" in out, out
    rc, out, err = cli(capsys, "show", pt, "block.0.weight")
    assert rc != 0 and "CRC32" in err and len(err.strip().splitlines()) == 1, err
    rc, out, err = cli(capsys, "export", pt, tmp_path / "x.safetensors")
    assert rc != 0 and "block.0.weight" in err and not (tmp_path / "x.safetensors").exists(), (out, err)


def test_kinds_of_single_files_and_dcp_by_keys(capsys, tmp_path, paths, fixtures):
    """A .ckpt with optimizer state is resumable and a plain state dict weights; a DCP folder is judged by the
    keys its metadata names: an imported model (weights only) is weights."""
    run = tmp_path / "run" / "checkpoints"
    run.mkdir(parents=True)
    assert cli(capsys, "import", paths["pt"], run / "step_10")[0] == 0
    (run / "step_20.ckpt").write_bytes(paths["ckpt"].read_bytes())
    import shutil

    shutil.copytree(fixtures["fsdp2_r2"], run / "step_5")
    rc, out, _ = cli(capsys, "ls", tmp_path / "run", "--json")
    assert rc == 0, out
    import json

    kinds = {os.path.basename(c["path"]): c["kind"] for c in json.loads(out)["checkpoints"]}
    assert kinds == {"step_10": "weights", "step_20.ckpt": "resumable", "step_5": "resumable"}, kinds


def test_hf_cache_snapshot_links_open_and_other_links_do_not(tmp_path, paths):
    """The hub cache links a snapshot's files to ``<repo>/blobs/``: that layout opens; a link anywhere else is
    refused as leading out of the checkpoint folder."""
    repo = tmp_path / "models--x--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in paths["hf_folder"].iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        blob.write_bytes(f.read_bytes())
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    ckpt = open_checkpoint(snap)
    assert ckpt.tensors and not [p for p in ckpt.problems if p.kind == "missing_file"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    folder = tmp_path / "plain"
    folder.mkdir()
    for f in paths["hf_folder"].iterdir():
        (elsewhere / f.name).write_bytes(f.read_bytes())
        os.symlink(elsewhere / f.name, folder / f.name)
    from shardscope.backend.errors import CheckpointError

    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        open_checkpoint(folder / "model.safetensors.index.json")


# ---------------------------------------------------------------- the door stays the only one
def test_lightning_meta_pt_is_its_formats_file(capsys, tmp_path):
    """meta.pt is listed, read and checked by formats.lightning alone: a file of the opened checkpoint, shown by
    inspect, and a meta.pt that does not load is a deep check's problem naming it (exit 1), not a crash."""
    import torch.distributed.checkpoint as dcp
    from shardscope.backend.formats.lightning import has_trainer_state, trainer_state

    folder = tmp_path / "epoch=0-step=3.ckpt"
    dcp.save({"model": {"w": torch.ones(2, 2)}}, checkpoint_id=folder)
    torch.save({"epoch": 0, "global_step": 3}, folder / "meta.pt")
    ckpt = open_checkpoint(folder, use_cache=False)
    assert ckpt.format == "lightning" and has_trainer_state(ckpt)
    assert [f.kind for f in ckpt.files if f.name == "meta.pt"] == ["meta.pt"]
    assert trainer_state(ckpt) == {"epoch": 0, "global_step": 3}
    assert formats.verify_contents(ckpt) == []
    rc, out, _ = cli(capsys, "inspect", folder)
    assert rc == 0 and "meta.pt    epoch 0, global_step 3" in out
    (folder / "meta.pt").write_bytes(b"PK not a torch file")
    problems = formats.verify_contents(open_checkpoint(folder, use_cache=False))
    assert [(p.kind, p.file) for p in problems] == [("unreadable", "meta.pt")]
    rc, out, err = cli(capsys, "verify", folder, "--deep")
    assert rc == 1 and "meta.pt" in out + err and "Traceback" not in err


FORMAT_NAMES = {f.name for f in formats.FORMATS} | {"dcp-safetensors", "torch-file"}
OUTSIDE = [p for d in ("backend", "app", "widgets") for p in (ROOT / d).rglob("*.py")
           if "formats" not in p.relative_to(ROOT).parts]


def _constants(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [c for e in node.elts for c in _constants(e)]
    return []


def _is_format_of(node: ast.AST) -> bool:
    """``x.format`` or a name ``fmt``/``format``: what holds a checkpoint's format."""
    return (isinstance(node, ast.Attribute) and node.attr == "format") or \
        (isinstance(node, ast.Name) and node.id in ("fmt", "format"))


def _chosen(node: ast.AST) -> list[ast.AST]:
    """What an assigned value may be: itself, or either branch of ``a if c else b`` / ``a or b`` (not what a call
    is given)."""
    if isinstance(node, ast.IfExp):
        return _chosen(node.body) + _chosen(node.orelse)
    if isinstance(node, ast.BoolOp):
        return [n for v in node.values for n in _chosen(v)]
    return [node]


def test_no_module_outside_formats_compares_a_format_name():
    """Nor assigns one: ``fmt = "megatron" if ... else ...`` decides a format outside the door too."""
    found = []
    for path in OUTSIDE:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            sides: list[ast.AST] = []
            if isinstance(node, ast.Compare) and any(map(_is_format_of, (node.left, *node.comparators))):
                sides = [node.left, *node.comparators]
            elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None and \
                    any(map(_is_format_of, node.targets if isinstance(node, ast.Assign) else [node.target])):
                sides = _chosen(node.value)
            for side in sides:
                hit = [c for c in _constants(side) if c in FORMAT_NAMES]
                if hit:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {hit}")
    # NOTE: an export's output format is the writer registry's business (safetensors, torch, dcp outputs)
    found = [f for f in found if "export/" not in f and "export_dialog" not in f and "cli/export" not in f]
    assert not found, "format names compared outside backend/formats:\n" + "\n".join(found)


FILE_RULES = {".metadata", ".distcp", "meta.pt", "model.safetensors.index.json", "pytorch_model.bin.index.json",
              ".shardscope-tmp-", "trainer_state.json", ".metadata.tmp"}
# NOTE: a run folder's config.json is the run's (RunDir's) name, not a checkpoint's; "latest" and the like are words
NOT_FILE_RULES = {"config.json"}


def _filename_rules() -> set[str]:
    """Every file name, suffix and prefix filenames.py spells (its string constants that name a file: a dot in
    them, not a regular expression), and :data:`FILE_RULES`."""
    found = set(FILE_RULES)
    for node in ast.walk(ast.parse((ROOT / "backend" / "filenames.py").read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            v = node.value
            if "." in v.strip(".") or (v.startswith(".") and len(v) > 2):
                if not any(c in v for c in "^$\\()[]*? ") and v not in NOT_FILE_RULES:
                    found.add(v)
    return found


def _spelled(text: str, rules: set[str], loose: bool) -> str | None:
    """The rule ``text`` spells: equal to one, a path ending in one (``sub/meta.pt``), and, ``loose`` (a piece
    of an f-string, what ``endswith``/``startswith`` or ``in`` test), any name ending in one (``_0.distcp``,
    ``_model_states.pt``) or starting with a temporary's prefix. Text with a space is a message, not a name."""
    if not text or any(c.isspace() for c in text):
        return None
    for rule in rules:
        if text == rule or text.endswith("/" + rule):
            return rule
        if loose and (text.endswith(rule) or (rule.endswith("-") and text.startswith(rule))):
            return rule
    return None


def _loose_strings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are pieces of f-strings, arguments of ``endswith``/``startswith``, or
    what ``in`` looks for: where a file name is spelled in parts."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            out.update(id(v) for v in node.values if isinstance(v, ast.Constant))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("endswith", "startswith", "removesuffix", "removeprefix"):
            out.update(id(c) for a in node.args for c in ast.walk(a) if isinstance(c, ast.Constant))
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
            out.update(id(c) for c in ast.walk(node.left) if isinstance(c, ast.Constant))
    return out


def test_file_name_rules_are_spelled_once():
    """Checkpoint file names and patterns live in backend/filenames.py (messages may mention them): as constants,
    in f-strings (``f"__{rank}_0.distcp"``), in ``endswith``/``startswith`` and ``in`` tests."""
    rules = _filename_rules()
    found = []
    for path in OUTSIDE:
        if path.name == "filenames.py":
            continue
        tree = ast.parse(path.read_text())
        loose = _loose_strings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                v = node.value
                rule = _spelled(v, rules, id(node) in loose)
                if rule or ("distcp" in v and v.startswith("^")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {v!r}")
            if isinstance(node, ast.Tuple) and {".pt", ".safetensors"} & set(_constants(node)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {_constants(node)}")
    assert not found, "file-name rules outside backend/filenames.py:\n" + "\n".join(found)


def test_the_file_name_guard_sees_names_spelled_in_parts():
    """The guard above is not blind: an f-string, an ``endswith`` and an ``in`` test of a file name are caught;
    a message that mentions one, and a module path ending like a name, are not."""
    rules = _filename_rules()
    assert {".distcp", "meta.pt", ".safetensors", ".pt", "trainer_state.json"} <= rules
    source = ('names = [f"__{r}_0.distcp" for r in ranks]\n'
              'ok = name.endswith("_model_states.pt") or "/meta.pt" in name or f"{d}/.metadata"\n'
              'msg = f"{path}: no .metadata: the save did not finish"\n'
              'mod = "torch.distributed.checkpoint.metadata"\n')
    tree = ast.parse(source)
    loose = _loose_strings(tree)
    hits = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and _spelled(n.value, rules, id(n) in loose)]
    assert sorted(hits) == ["/.metadata", "/meta.pt", "_0.distcp", "_model_states.pt"]
