"""Help inside the app (no network): keyboard shortcuts, what a shard map shows, how export chooses
keys, where runs and logs live, and the README itself."""

from __future__ import annotations

import html
import platform
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import PySide6
from PySide6.QtCore import QUrl, qVersion
from PySide6.QtGui import QImageReader, QKeySequence, QTextCursor
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QMainWindow, QTextBrowser, QVBoxLayout, QWidget

from ..backend.log import log_file
from ..backend.runs.rundir import default_runs_root
from ..backend.version import __version__
from ..resources import base_dir, readme_text


@dataclass(frozen=True)
class HelpTopic:
    key: str
    title: str  # menu text
    shortcut: str = ""


def help_topics() -> list[HelpTopic]:
    """The Help menu, in order."""
    return [HelpTopic("shortcuts", "&Keyboard shortcuts", "F1"), HelpTopic("shard_map", "What a &shard map shows"),
            HelpTopic("export", "How &export chooses keys"), HelpTopic("runs", "Where &runs and logs live"),
            HelpTopic("readme", "&README")]


VIEW_KEYS = [
    ("Wheel / drag / double-click on a shard map", "zoom / pan / fit the whole tensor"),
    ("Hover a chunk, a heat-map cell or a bar", "exact rank, tensor, offsets, file and bytes"),
    ("Click a bar in Ranks", "highlight that rank's chunks and filter the tree (click again to clear)"),
    ("Ctrl+C in the Inspector", "copy the chunk table as tab-separated text"),
    ("Right-click in the tree", "export a subtree, copy a name"),
    ("Down or Enter in the filter box", "go on to the matches in the tree (the first one selected)"),
    ("Enter or double-click on a checkpoint", "open it (the Library, a run's Checkpoints in Training)"),
    ("Drop a folder or a checkpoint file on the window", "open it"),
]

SHARD_MAP = """
<h3>What a shard map shows</h3>
<p>Each tensor is drawn to scale: a 2-D tensor as rows × columns, a 1-D tensor as a bar, an N-D tensor as its
first dimension × the product of the others, a scalar as one cell. Every rectangle is one <b>chunk</b> as the
checkpoint's <tt>.metadata</tt> records it, filled with the colour of the rank that <b>wrote</b> it
(rank <i>r</i> has the same colour everywhere: map, bars, chunk table).</p>
<p><b>Writer rank, not holder.</b> DCP writes a replicated tensor (DDP, or FSDP's replicated parts) only once,
from one rank, to that rank's <tt>__R_N.distcp</tt> file. A rank that held the same values but did not write
them does not appear. So a DDP checkpoint shows one colour per tensor, an FSDP checkpoint one band per rank.</p>
<p><b>Gaps</b> (elements in no chunk: the tensor cannot be loaded whole) are hatched red; <b>overlaps</b> (elements
in more than one chunk) are outlined with a dashed red line. Either is also listed in the Health tab, with the
index ranges. A module shows its tensors stacked, each scaled to the same width; hover anything for the
exact rank, offsets, sizes, file and byte range.</p>
<p>The <b>Ranks</b> tab adds up what each writer rank wrote (bytes and chunks), lists the files in natural
order, and draws a tensors × ranks heat map of bytes written, with its colour scale.</p>
"""

EXPORT = """
<h3>How export chooses keys</h3>
<ul>
<li><b>Which entries:</b> <tt>--only PREFIX</tt> (repeatable) keeps entries equal to or under each prefix. With
no <tt>--only</tt>, a <b>safetensors</b> export keeps the <tt>model.</tt> tensors when the checkpoint has any
(the weights, not the optimizer state); a <b>torch</b> export keeps everything. What is left out is listed in
the preview and in the summary.</li>
<li><b>Names:</b> every key is the tensor's dotted name in the checkpoint (DCP's flattened name, e.g.
<tt>model.layers.0.attn.q.weight</tt>, <tt>optimizer.state.model.layers.0.attn.q.weight.exp_avg</tt>).
<tt>--strip-prefix model.</tt> removes a leading prefix (what <tt>load_state_dict</tt> of the bare module
expects); two entries that would become the same key stop the export with both names.</li>
<li><b>Torch output</b> is the nested dictionary that torch's <tt>dcp_to_torch_save</tt> writes (for a
Lightning/Fabric folder, <tt>meta.pt</tt> merged at the top level), loadable with
<tt>torch.load(..., weights_only=True)</tt>.</li>
<li><b>Safetensors output</b> holds tensors only; scalars and strings go to
<tt>__metadata__["shardscope_objects"]</tt>. <tt>--max-shard-size</tt> writes an HF-style folder with
<tt>model.safetensors.index.json</tt>. <tt>--dtype bf16|fp16|fp32</tt> casts floating-point tensors only.</li>
<li>Every output is written to a temporary name, synced and renamed, then read back and compared bit for bit
with the source (unless <tt>--no-verify</tt>).</li>
</ul>
"""


def runs_html(runs_root: str, log_file: str) -> str:
    return f"""
<h3>Where runs and logs live</h3>
<p>Runs started here or with <tt>shardscope train</tt> / <tt>shardscope demo</tt> live under
<br><tt>{html.escape(runs_root)}</tt><br>(set <tt>--run-dir</tt> for another place). One folder per run:</p>
<ul>
<li><tt>config.json</tt>: what was asked (strategy, ranks, steps, model or script);</li>
<li><tt>status.json</tt>: state, per-rank exit codes, times, written by the run's supervisor (a small process
that owns the run; <tt>stop.request</tt> asks it to stop);</li>
<li><tt>metrics/rank_N.jsonl</tt>: one line per <tt>report(step=..., loss=...)</tt>, with time and memory;</li>
<li><tt>logs/rank_N.log</tt> and <tt>logs/launcher.log</tt>: everything each rank printed;</li>
<li><tt>checkpoints/step_NNNNNN/</tt>: the DCP checkpoints (open one by double-clicking it in the Training tab).</li>
</ul>
<p>The window can be closed while a run trains (its supervisor carries on and records how it ends; from a
terminal: <tt>shardscope runs</tt>, <tt>shardscope follow RUN</tt>, <tt>shardscope stop RUN</tt>): reopen the run
folder (Run › Training panel › Open run folder,
or <tt>shardscope gui RUN_DIR</tt>) and it continues following. A job on a cluster that writes to shared
storage is followed the same way.</p>
<p>Shardscope's own log (errors with their tracebacks, for bug reports) is
<br><tt>{html.escape(log_file or "(not set up)")}</tt></p>
"""


def shortcuts_html(window: QMainWindow | None) -> str:
    """Every menu action that has a shortcut (read from the live menus, so it is never out of date)."""
    rows = []
    if window is not None:
        for menu_action in window.menuBar().actions():
            menu = menu_action.menu()
            for act in menu.actions() if menu is not None else []:
                key = act.shortcut().toString(QKeySequence.SequenceFormat.NativeText)
                if key:
                    name = f"{menu_action.text()} › {act.text()}".replace("&", "")
                    rows.append((key, name))
    rows += VIEW_KEYS
    body = "".join(f"<tr><td><b>{html.escape(k)}</b>&nbsp;&nbsp;</td><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<h3>Keyboard shortcuts and mouse</h3><table cellspacing='4'>{body}</table>"


ABOUT = """
<h3>Shardscope</h3>
<p>Browse, train, export and manage PyTorch distributed (DCP) checkpoints. Every action in the window is also
a <tt>shardscope</tt> subcommand (<tt>shardscope --help</tt>), for checkpoints on headless servers.</p>
"""


def about_text() -> str:
    """About, with the versions a bug report needs (Shardscope, torch, Qt, PySide6, Python)."""
    try:
        torch_version = version("torch")
    except PackageNotFoundError:  # a torch built from source without a distribution record
        torch_version = "unknown"
    return ABOUT + (f"<p>Version {__version__} &middot; torch {torch_version} &middot; Qt {qVersion()} "
                    f"(PySide6 {PySide6.__version__}) &middot; Python {platform.python_version()}</p>"
                    f"<p>Log file: <tt>{log_file()}</tt></p>")


class HelpDialog(QDialog):
    """One help page in a browser that never goes to the network."""

    def __init__(self, title: str, text: str, markdown: bool = False, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(title)
        self.browser = QTextBrowser()
        self.browser.setOpenExternalLinks(False)
        self.browser.setOpenLinks(False)  # NOTE: links to the web are not followed; the text says where
        self.browser.setSearchPaths([str(base_dir())])
        self.browser.document().setBaseUrl(QUrl.fromLocalFile(str(base_dir()) + "/"))
        if markdown:
            self.browser.setMarkdown(text)
            self._fit_images(680)
        else:
            self.browser.setHtml(text)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(self.browser)
        layout.addWidget(buttons)
        self.resize(760, 560)

    def _fit_images(self, width: int) -> None:
        """Screenshots in the README are drawn at most ``width`` pixels wide (aspect kept)."""
        doc = self.browser.document()
        block = doc.begin()
        while block.isValid():
            it = block.begin()
            while not it.atEnd():
                frag = it.fragment()
                fmt = frag.charFormat()
                if fmt.isImageFormat():
                    image = fmt.toImageFormat()
                    size = QImageReader(str(base_dir() / image.name())).size()
                    if size.isValid() and size.width() > width:
                        image.setWidth(width)
                        image.setHeight(size.height() * width / size.width())
                        cursor = QTextCursor(doc)
                        cursor.setPosition(frag.position())
                        cursor.setPosition(frag.position() + frag.length(), QTextCursor.MoveMode.KeepAnchor)
                        cursor.setCharFormat(image)
                it += 1
            block = block.next()


def help_text(key: str, window: QMainWindow | None = None) -> tuple[str, str, bool]:
    """(title, text, is_markdown) of a help topic."""
    if key == "shortcuts":
        return "Keyboard shortcuts", shortcuts_html(window), False
    if key == "shard_map":
        return "What a shard map shows", SHARD_MAP, False
    if key == "export":
        return "How export chooses keys", EXPORT, False
    if key == "runs":
        return "Runs and logs", runs_html(str(default_runs_root()), str(log_file())), False
    if key == "readme":
        return "README", readme_text() or "The README is not available in this installation.", True
    return "About Shardscope", about_text(), False


def show_help(window: QMainWindow, key: str) -> HelpDialog:
    """Show one topic (non-modal, so the user can follow it while using the window)."""
    title, text, markdown = help_text(key, window)
    dlg = HelpDialog(title, text, markdown, window)
    dlg.setModal(False)
    dlg.show()
    return dlg
