"""The Export dialog (widgets/export_dialog.py): its destination (proposed outside the run's checkpoints/
folder, made when missing), the layout preview, exclude and rename, resharding, progress past 2 GiB, options
locked while it runs, cancelling (a second export too), overwriting a model folder, and Open after an export."""

from __future__ import annotations

import json
import shutil

from gui_support import no_thread_left_running  # noqa: F401  (an autouse fixture)
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication
from safetensors import safe_open
from shardscope.backend.formats import open_checkpoint

SLOW = 120000  # ms: a checkpoint load or a background job on a loaded 2-core machine


def planned(qtbot, dlg) -> None:
    """Wait for the plan of the fields as they are (it is made in a worker once the typing pauses)."""
    qtbot.waitUntil(lambda: not dlg.planning, timeout=SLOW)


def test_default_destination_is_beside_checkpoints_and_made_when_missing(qtbot, fixtures, tmp_path):
    """It once proposed RUN/checkpoints/step_000030.safetensors, and prune then took that export for the run's
    newest checkpoint. Now RUN/exports/, made by the export (and removed again when the export fails)."""
    from shardscope.backend.formats import open_checkpoint
    from shardscope.widgets.export_dialog import ExportDialog

    run = tmp_path / "run"
    ck = run / "checkpoints" / "step_000030"
    shutil.copytree(fixtures["fsdp2_r2"], ck)
    dlg = ExportDialog(open_checkpoint(ck), "model")
    qtbot.addWidget(dlg)
    assert dlg.dst.text() == str(run / "exports" / "model.safetensors")
    dlg2 = ExportDialog(open_checkpoint(ck), "")
    qtbot.addWidget(dlg2)
    assert dlg2.dst.text() == str(run / "exports" / "step_000030.safetensors")
    planned(qtbot, dlg2)
    with qtbot.waitSignal(dlg2.finished_export, timeout=120000) as blocker:
        dlg2.export_button.click()
    assert blocker.args[0] is not None and blocker.args[0].verified is True, dlg2.message.text()
    with safe_open(str(run / "exports" / "step_000030.safetensors"), framework="pt") as h:
        assert len(list(h.keys())) == 15
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000030"]
    # a failing export into folders that do not exist leaves none of them behind
    (ck / "__0_0.distcp").write_bytes(b"damaged")
    dlg3 = ExportDialog(open_checkpoint(ck), "model")
    qtbot.addWidget(dlg3)
    dlg3.dst.setText(str(tmp_path / "new" / "deeper" / "m.safetensors"))
    planned(qtbot, dlg3)
    with qtbot.waitSignal(dlg3.finished_export, timeout=120000) as blocker:
        dlg3.export_button.click()
    assert blocker.args[0] is None and "Nothing was written" in dlg3.message.text()
    assert not (tmp_path / "new").exists()


def test_progress_sizes_past_2_gib_cross_the_qt_boundary(qtbot, fixtures):
    from shardscope.widgets.export_dialog import ExportDialog
    from shardscope.widgets.workers import WorkerSignals

    dlg = ExportDialog(open_checkpoint(fixtures["nopg"]), "")
    qtbot.addWidget(dlg)
    signals = WorkerSignals()
    signals.progress.connect(dlg._on_progress)
    signals.progress.emit(3 << 30, 5 << 30, "exporting")
    assert dlg.progress.text().endswith("3.0 GiB of 5.0 GiB"), dlg.progress.text()
    assert dlg.progress.value() == dlg.progress.maximum() * 3 // 5


def test_dialog_shows_layout_and_takes_exclude_and_rename(qtbot, fixtures, tmp_path):
    from shardscope.widgets.export_dialog import ExportDialog

    dlg = ExportDialog(open_checkpoint(fixtures["fsdp2_r2"]), "")
    qtbot.addWidget(dlg)
    dlg.dst.setText(str(tmp_path / "m.safetensors"))
    planned(qtbot, dlg)
    assert "layout: torch DCP recipe" in dlg.summary.text()
    n = len(dlg.keys.stringList())
    dlg.exclude.setText("model.head")
    planned(qtbot, dlg)
    assert len(dlg.keys.stringList()) < n
    dlg.rename.setText(r"^emb\.=embed.")
    planned(qtbot, dlg)
    assert any(k.startswith("embed.weight") for k in dlg.keys.stringList())
    dlg.exclude.setText("model.nosuch")
    planned(qtbot, dlg)
    assert not dlg.export_button.isEnabled() and "matches no entry" in dlg.summary.text()


def test_export_dialog_previews_runs_and_cancels(qtbot, fixtures, tmp_path):
    from safetensors import safe_open
    from shardscope.backend.formats import open_checkpoint
    from shardscope.widgets.export_dialog import ExportDialog

    ckpt = open_checkpoint(fixtures["fsdp2_r4"])
    dlg = ExportDialog(ckpt, "model")
    qtbot.addWidget(dlg)
    dlg.dst.setText(str(tmp_path / "m.safetensors"))
    planned(qtbot, dlg)
    assert dlg.strip.text() == "model."
    keys = dlg.keys.stringList()
    assert len(keys) == 15 and all(not k.startswith("model.") for k in keys)
    assert "15 tensors" in dlg.summary.text()
    dlg.shard.setText("not a size")
    assert not dlg.export_button.isEnabled() and "not a size" in dlg.summary.text()
    dlg.shard.setText("")
    planned(qtbot, dlg)
    with qtbot.waitSignal(dlg.finished_export, timeout=120000) as blocker:
        dlg.export_button.click()
    result = blocker.args[0]
    assert result is not None and result.verified is True
    assert not dlg.show_button.isHidden()
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as h:
        assert set(h.keys()) == {k.split()[0] for k in keys}
    assert "verified" in dlg.message.text()
    dlg.dst.setText(str(tmp_path / "m.pt"))  # another destination: the last result line is stale
    assert dlg.message.text() == "" and dlg.show_button.isHidden() and dlg.result is None
    # cancel: the worker stops at its next progress check and nothing is left behind
    dlg2 = ExportDialog(ckpt, "")
    qtbot.addWidget(dlg2)
    dlg2.dst.setText(str(tmp_path / "all.pt"))
    planned(qtbot, dlg2)
    with qtbot.waitSignal(dlg2.finished_export, timeout=120000) as blocker:  # NOTE: listening before it starts
        dlg2.start()
        dlg2._worker.quit()
    assert blocker.args[0] is None
    assert not (tmp_path / "all.pt").exists()
    # no temporary of any name left: the output and its lineage sidecar
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "m.safetensors.shardscope-manifest.json",
                                                          "m.safetensors.shardscope.json"]  # and its manifest


def test_export_dialog_reshards(qtbot, fixtures, tmp_path):
    from shardscope.backend.formats import open_checkpoint
    from shardscope.widgets.export_dialog import ExportDialog

    ckpt = open_checkpoint(fixtures["fsdp2_r2"])
    dlg = ExportDialog(ckpt, "")
    qtbot.addWidget(dlg)
    dlg.format.setCurrentText("DCP (reshard)")
    dlg.ranks.setValue(3)
    dlg.dst.setText(str(tmp_path / "r3"))
    planned(qtbot, dlg)
    assert "3 ranks" in dlg.summary.text() and not dlg.dtype.isEnabled()
    planned(qtbot, dlg)
    with qtbot.waitSignal(dlg.finished_export, timeout=120000) as blocker:
        dlg.export_button.click()
    assert blocker.args[0] is not None and blocker.args[0].verified is True
    assert open_checkpoint(tmp_path / "r3").ranks == [0, 1, 2]


def export_dialog(qtbot, fixtures, dst):
    from shardscope.backend.formats import open_checkpoint
    from shardscope.widgets.export_dialog import ExportDialog

    dlg = ExportDialog(open_checkpoint(fixtures["fsdp2_r2"]))
    qtbot.addWidget(dlg)
    dlg.dst.setText(str(dst))
    planned(qtbot, dlg)
    return dlg


def test_export_dialog_locks_every_option_while_it_runs(qtbot, fixtures, tmp_path):
    """Only destination, format, verify and overwrite were locked during an export: typing into Only,
    Exclude, Rename or Max shard size replaced the plan and the preview while the old plan was written."""
    dlg = export_dialog(qtbot, fixtures, tmp_path / "m.safetensors")
    planned(qtbot, dlg)
    with qtbot.waitSignal(dlg.finished_export, timeout=120000) as sig:
        dlg.export_button.click()
        assert [w for w in dlg.option_widgets() if w.isEnabled()] == []
    assert sig.args[0] is not None and (tmp_path / "m.safetensors").exists()
    assert dlg.only.isEnabled() and dlg.shard.isEnabled() and dlg.dst.isEnabled()
    assert not dlg.ranks.isEnabled()  # used by DCP (reshard) only


def test_export_dialog_speaks_of_no_command_line_flag(qtbot, fixtures, tmp_path):
    """A destination that exists said "give --force to overwrite it": the dialog has no --force. The backend's
    messages now name options in words, and the dialog shows them as they are."""
    (tmp_path / "m.safetensors").write_bytes(b"keep me")
    dlg = export_dialog(qtbot, fixtures, tmp_path / "m.safetensors")
    planned(qtbot, dlg)
    with qtbot.waitSignal(dlg.finished_export, timeout=120000):
        dlg.export_button.click()
    assert "--" not in dlg.message.text() and "allow overwriting it" in dlg.message.text()
    assert (tmp_path / "m.safetensors").read_bytes() == b"keep me"
    dlg.dst.setText(str(tmp_path / "noext"))
    planned(qtbot, dlg)
    assert "--" not in dlg.summary.text() and "maximum shard size" in dlg.summary.text()
    dlg.dst.setText(str(tmp_path / "m2.safetensors"))
    dlg.only.setText("nothing.here")
    planned(qtbot, dlg)
    assert "--" not in dlg.summary.text() and "nothing.here (a prefix to export) matches no entry" in dlg.summary.text()


def test_format_list_is_the_writer_registry(qtbot, fixtures, tmp_path):
    """The Format list was typed out in the dialog; now it is the registry's labels (after "from the name"), and
    the fields a format does not take are disabled and not read."""
    from shardscope.backend.export import WRITERS

    dlg = export_dialog(qtbot, fixtures, tmp_path / "m.pt")
    items = [(dlg.format.itemText(i), dlg.format.itemData(i)) for i in range(dlg.format.count())]
    assert items == [("from the name", None), *((w.label, w.name) for w in WRITERS.values())]
    fields = dlg.option_fields()
    for i in range(1, dlg.format.count()):
        dlg.format.setCurrentIndex(i)
        takes = WRITERS[dlg.format.currentData()].options
        assert {n for n, f in fields.items() if f.isEnabled()} == set(fields) & takes, dlg.format.currentText()
    dlg.format.setCurrentText(WRITERS["torch"].label)
    dlg.shard.setText("5GB")  # not taken by torch: disabled, and no error about it
    planned(qtbot, dlg)
    assert not dlg.shard.isEnabled() and dlg.export_button.isEnabled(), dlg.summary.text()
    dlg.format.setCurrentIndex(0)  # from the name: a maximum shard size makes a sharded safetensors folder
    planned(qtbot, dlg)
    assert dlg.shard.isEnabled() and "in shards of at most" in dlg.summary.text()


def test_a_second_export_from_the_dialog_can_be_cancelled(qtbot, fixtures, tmp_path):
    """After one export the dialog swaps Cancel for Close; a second export (another destination) then ran with
    only Close, which shut the dialog instead of stopping the export, and Show in folder still pointed at the
    first output."""
    from shardscope.backend.formats import open_checkpoint
    from shardscope.widgets.export_dialog import ExportDialog

    dlg = ExportDialog(open_checkpoint(fixtures["fsdp2_r2"]))
    qtbot.addWidget(dlg)
    dlg.show()
    dlg.dst.setText(str(tmp_path / "a.safetensors"))
    planned(qtbot, dlg)
    with qtbot.waitSignal(dlg.finished_export, timeout=SLOW) as first:
        dlg.export_button.click()
    assert first.args[0] is not None
    assert dlg.close_button.isVisibleTo(dlg) and not dlg.cancel_button.isVisibleTo(dlg)
    dlg.dst.setText(str(tmp_path / "b.pt"))
    planned(qtbot, dlg)
    with qtbot.waitSignal(dlg.finished_export, timeout=SLOW) as second:
        dlg.export_button.click()
        # the results arrive through the event loop: this is the dialog while the second export runs
        assert dlg.cancel_button.isVisibleTo(dlg) and dlg.cancel_button.isEnabled()
        assert not dlg.close_button.isVisibleTo(dlg) and not dlg.show_button.isVisibleTo(dlg)
    assert second.args[0] is not None and (tmp_path / "b.pt").exists()
    assert dlg.close_button.isVisibleTo(dlg) and dlg.show_button.isVisibleTo(dlg)


def test_overwrite_into_a_model_folder_keeps_the_files_an_export_does_not_write(qtbot, fixtures, tmp_path):
    """Export (sharded, Overwrite ticked) into an existing HF model folder replaced the whole folder: its
    config.json and tokenizer.json were deleted without a word (then its pytorch_model.bin, an export's kind of
    file). Now only an earlier export's own files go, the folder's other files stay, and the result says which
    were kept."""
    from shardscope.backend.formats import open_checkpoint
    from shardscope.widgets.export_dialog import ExportDialog

    folder = tmp_path / "llama-hf"
    (folder / "tokenizer").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer" / "tokenizer.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"old weights")
    dlg = ExportDialog(open_checkpoint(fixtures["fsdp2_r2"]))
    qtbot.addWidget(dlg)
    dlg.dst.setText(str(folder))
    dlg.shard.setText("3KB")
    dlg.force.setChecked(True)
    planned(qtbot, dlg)
    with qtbot.waitSignal(dlg.finished_export, timeout=SLOW) as done:
        dlg.export_button.click()
    assert done.args[0] is not None, dlg.message.text()
    names = sorted(p.name for p in folder.iterdir())
    assert "config.json" in names and "tokenizer" in names and "pytorch_model.bin" in names
    assert (folder / "tokenizer" / "tokenizer.json").read_text() == "{}"
    assert "model.safetensors.index.json" in names
    assert "kept in the folder (not written by an export): config.json, pytorch_model.bin, tokenizer" in \
        dlg.message.text()
    dlg.shard.setText("5KB")  # over its own earlier export: the old shards go, the kept files stay
    planned(qtbot, dlg)
    with qtbot.waitSignal(dlg.finished_export, timeout=SLOW) as again:
        dlg.export_button.click()
    assert again.args[0] is not None
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert {p.name for p in folder.iterdir()} == {*shards, "model.safetensors.index.json", "config.json",
                                                  "pytorch_model.bin", "tokenizer", "shardscope-manifest.json"}


def test_open_after_an_export_shows_the_written_file_in_the_window(qtbot, fixtures, tmp_path):
    """After File › Export the only way to look at the result was File › Open file and typing its path again;
    Open now brings the written file (or sharded folder) up in a tab and closes the dialog."""
    from shardscope.app.main_window import MainWindow
    from shardscope.widgets.export_dialog import ExportDialog

    win = MainWindow()
    qtbot.addWidget(win)
    win.quiet = True
    view = win.open_path(str(fixtures["fsdp2_r2"]))
    qtbot.waitUntil(lambda: view.data is not None, timeout=SLOW)
    dst = tmp_path / "sharded"
    seen: dict[str, bool] = {}

    def drive() -> None:  # runs inside the dialog's exec()
        dlg = QApplication.activeModalWidget()
        if not isinstance(dlg, ExportDialog):
            QTimer.singleShot(50, drive)
            return
        try:
            assert dlg.open_button.isHidden()  # nothing written yet
            dlg.dst.setText(str(dst))
            dlg.shard.setText("3KB")
            planned(qtbot, dlg)
            with qtbot.waitSignal(dlg.finished_export, timeout=SLOW):
                dlg.export_button.click()
            seen["shown"] = dlg.open_button.isVisibleTo(dlg)
            dlg.open_button.click()
        finally:
            dlg.reject()  # a no-op once Open has closed it

    QTimer.singleShot(0, drive)
    win.export_current("")
    assert seen == {"shown": True}
    opened = win.current_view()
    assert opened is not view and opened.path == str(dst)
    qtbot.waitUntil(lambda: opened.data is not None, timeout=SLOW)
    assert len(opened.data.ckpt.tensors) == 15


def test_the_dialog_offers_to_create_a_missing_destination_folder(qtbot, fixtures, tmp_path):
    """`export` refuses a destination whose folder is missing (kept); the dialog says it is missing and offers to
    create it: ticked (as it comes) the export makes it, unticked it refuses as the CLI does."""
    from shardscope.widgets.export_dialog import ExportDialog

    dlg = ExportDialog(open_checkpoint(fixtures["fsdp2_r2"]), "model")
    qtbot.addWidget(dlg)
    dlg.show()
    dst = tmp_path / "new" / "deeper" / "m.safetensors"
    dlg.dst.setText(str(dst))
    offer = dlg.make_folders
    assert offer.isVisibleTo(dlg) and offer.isChecked()
    QApplication.processEvents()
    format_at = dlg.format.mapTo(dlg, dlg.format.rect().topLeft()).y()
    assert offer.text().endswith("/new (and 1 folder in it)") and str(tmp_path / "new") in offer.toolTip()
    offer.setChecked(False)
    planned(qtbot, dlg)
    with qtbot.waitSignal(dlg.finished_export, timeout=120000) as refused:
        dlg.export_button.click()
    assert refused.args[0] is None and "does not exist" in dlg.message.text() and not (tmp_path / "new").exists()
    offer.setChecked(True)
    planned(qtbot, dlg)
    with qtbot.waitSignal(dlg.finished_export, timeout=120000) as done:
        dlg.export_button.click()
    assert done.args[0] is not None and dst.is_file(), dlg.message.text()
    dlg.dst.setText(str(tmp_path / "new" / "again.safetensors"))  # its folder is there now: nothing to offer
    assert not offer.isVisibleTo(dlg)
    QApplication.processEvents()  # the rows below did not move as the offer came and went
    assert dlg.format.mapTo(dlg, dlg.format.rect().topLeft()).y() == format_at


def test_the_dialog_plans_off_the_gui_thread_and_never_shows_a_stale_plan(qtbot, fixtures, tmp_path, monkeypatch):
    """The dialog planned on the GUI thread on opening and on every key (0.2 s a key at 20k tensors, 5 s at 300k).
    Now the plan is made in a worker once the typing pauses; Export waits for the plan of the fields as they are,
    and a plan that comes back after the fields changed is never shown. (The backend's plan_export, slowed down
    here, stands for a checkpoint of 300k tensors.)"""
    import threading
    import time

    from shardscope.widgets import export_dialog

    planned_in: list[tuple[str, list | None]] = []
    real_plan = export_dialog.plan_export

    def slow_plan(ckpt, fmt, **kw):
        planned_in.append((threading.current_thread().name, kw.get("exclude")))
        time.sleep(0.6)
        return real_plan(ckpt, fmt, **kw)

    monkeypatch.setattr(export_dialog, "plan_export", slow_plan)
    dlg = export_dialog.ExportDialog(open_checkpoint(fixtures["fsdp2_r2"]), "")
    qtbot.addWidget(dlg)
    dlg.show()
    qtbot.waitUntil(lambda: bool(planned_in), timeout=SLOW)
    assert planned_in[0][0] != threading.main_thread().name  # opening planned on the GUI thread (4 s at 300k)
    assert dlg.planning and not dlg.export_button.isEnabled()
    planned(qtbot, dlg)
    n = len(dlg.keys.stringList())
    shown: list[tuple[str, int]] = []  # (exclude field, keys in the preview) each time the preview is filled
    dlg.keys.modelReset.connect(lambda: shown.append((dlg.exclude.text(), len(dlg.keys.stringList()))))
    typed = time.monotonic()
    for key in "model.head":  # typed a key at a time: no key waits for a plan
        dlg.exclude.setText(dlg.exclude.text() + key)
    assert time.monotonic() - typed < 3  # (on the GUI thread: 10 plans, 6 s)
    qtbot.waitUntil(lambda: len(planned_in) == 2, timeout=SLOW)  # the plan of "model.head" is under way
    dlg.exclude.setText("")  # ... and the fields change before it is back
    assert not dlg.export_button.isEnabled()
    dlg.start()  # Export waits for the plan of the fields as they are
    assert dlg._worker is None
    planned(qtbot, dlg)
    assert dlg.export_button.isEnabled() and len(dlg.keys.stringList()) == n
    assert all(name != threading.main_thread().name for name, _ in planned_in), planned_in  # opening's too
    assert [exclude for _, exclude in planned_in] == [None, ["model.head"], None]  # once per pause, not per key
    assert all(count == 0 or field == "" for field, count in shown), shown  # "model.head"'s plan never shown


def test_hugging_face_model_output_shows_the_architecture_and_writes_what_the_cli_writes(qtbot, tmp_path):
    """Hugging Face model output: before it starts, the architecture the weights' names say and the transforms it
    will apply; a checkpoint that records no HF config gives the CLI's one line with Export disabled until a
    config.json is chosen; the folder written is the CLI's, byte for byte."""
    import html

    from conftest import run_cli
    from shardscope.widgets.export_dialog import ExportDialog
    from titan_names import LAYERS, same_model_folder, write, write_config

    ckpt = tmp_path / "run" / "checkpoints" / "step_000010"
    write(ckpt)
    config = write_config(tmp_path / "config.json")
    dlg = ExportDialog(open_checkpoint(ckpt))
    qtbot.addWidget(dlg)
    dlg.show()
    dlg.format.setCurrentText("Hugging Face model")
    assert dlg.dst.text() == str(tmp_path / "run" / "exports" / "step_000010-hf")  # a folder, beside checkpoints/
    dlg.dst.setText(str(tmp_path / "dialog-hf"))
    planned(qtbot, dlg)
    qtbot.waitUntil(lambda: "Recognised" in dlg.model_line.text(), timeout=SLOW)
    assert "torchtitan Llama 3 (interleaved rotary" in dlg.model_line.text()
    cli = run_cli("export", ckpt, tmp_path / "none", "--hf")
    assert cli.returncode == 2 and len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    line = cli.stderr.strip().split(": ", 1)[1]  # after the program's name
    assert html.escape(line) in dlg.summary.text() and not dlg.export_button.isEnabled()
    dlg.config.setText(str(config))
    planned(qtbot, dlg)
    summary = dlg.summary.text()
    assert "torchtitan names -&gt; Hugging Face LlamaForCausalLM" in summary and "model_type llama" in summary
    assert f"rotary permutation of q and k in {LAYERS} layers" in summary, summary
    assert dlg.export_button.isEnabled()
    with qtbot.waitSignal(dlg.finished_export, timeout=SLOW) as done:
        dlg.export_button.click()
    assert done.args[0] is not None and done.args[0].verified is True, dlg.message.text()
    run_cli("export", ckpt, tmp_path / "cli-hf", "--hf", "--config", config, check=True)
    same_model_folder(tmp_path / "dialog-hf", tmp_path / "cli-hf")
