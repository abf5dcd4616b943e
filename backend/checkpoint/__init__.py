"""The checkpoint model (:mod:`.model`), the readers the formats use (DCP metadata, safetensors headers, torch
files), layout and health analysis, and the chunk reader. Opening a path is the formats' job:
``backend.formats.open_checkpoint``. Nothing is imported here, so a listing's probes can use the plain parsers
(:mod:`.items`, :mod:`.dtypes`) without numpy."""
