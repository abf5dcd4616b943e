"""Shardscope's version, in the bottom layer so that the window's About (widgets/) and the top package both
import it downward."""

__version__ = "0.1.0"
