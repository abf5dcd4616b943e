"""Qt widgets and item models that adapt backend objects; no file I/O or torch logic."""
