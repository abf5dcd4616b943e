"""Shardscope's Qt-free core: checkpoint reading, layout analysis, export and training runs."""
