"""The oracle behind tests/test_import_hf.py, run as a subprocess: for each variant folder under ROOT (``hf/``, an HF
Llama that ``save_pretrained`` wrote, with ``tokens.safetensors`` and its ``logits.safetensors``; and ``tt*/``, what
``shardscope import --as torchtitan`` wrote from it), torchtitan's own Llama 3 model loads ``tt*/`` with ``dcp.load``
and runs on the tokens, and its state dict is compared with torchtitan's own ``Llama3StateDictAdapter.from_hf`` of
the HF weights, bit for bit.

    python tests/torchtitan_import_check.py ROOT

prints one JSON object: variant/import -> {"keys": [missing, unexpected], "unequal": [...], "logits": max diff}."""

from __future__ import annotations

import json
import os
import sys

from torchtitan_writer import SEQ, build


def check(folder: str, imported: str) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    config = json.load(open(os.path.join(folder, "hf", "config.json"), encoding="utf-8"))
    cfg, model = build(config["num_attention_heads"], config["num_key_value_heads"], config["tie_word_embeddings"])
    state = model.state_dict()
    for v in state.values():  # nothing left from the random init can pass for a loaded value
        v.detach().fill_(float("nan"))
    dcp.load(state, checkpoint_id=os.path.join(folder, imported), no_dist=True)
    model.load_state_dict(state)
    hf = load_file(os.path.join(folder, "hf", "model.safetensors"))
    reference = Llama3StateDictAdapter(cfg, None).from_hf(dict(hf))
    written = load_file_dcp(os.path.join(folder, imported))
    keys = [sorted(set(reference) - set(written)), sorted(set(written) - set(reference))]
    unequal = [k for k in reference if k in written and not (written[k].dtype == reference[k].dtype
                                                            and torch.equal(written[k], reference[k]))]
    tokens = load_file(os.path.join(folder, "tokens.safetensors"))["tokens"]
    want = load_file(os.path.join(folder, "logits.safetensors"))["logits"]
    positions = torch.arange(SEQ).repeat(tokens.shape[0], 1)
    with torch.no_grad():
        got = model(tokens, positions, model.get_attention_masks(positions)).float()
    return {"keys": keys, "unequal": unequal, "logits": float((got - want).abs().max())}


def load_file_dcp(path: str) -> dict:
    """Every tensor of a DCP checkpoint, as torch's own ``dcp_to_torch_save`` reads it."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, os.path.join(tmp, "all.pt"))
        return torch.load(os.path.join(tmp, "all.pt"), weights_only=True)


def main(root: str) -> None:
    report = {}
    for variant in sorted(os.listdir(root)):
        for imported in sorted(os.listdir(os.path.join(root, variant))):
            if imported.startswith("tt") and not imported.endswith(".json"):
                report[f"{variant}/{imported}"] = check(os.path.join(root, variant), imported)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
