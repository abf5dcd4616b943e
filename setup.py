"""Packages are found, not listed (everything else is in pyproject.toml).

The folders stay short at the top level (app/, backend/, widgets/, resources/) but install under one
package, ``shardscope``; ``[tool.setuptools.package-dir]`` maps them. A hand-kept list once forgot
``shardscope.backend.compare`` and the installed window did not start, so every folder below them with
Python files or data is a package here, and tests/test_install.py checks the built wheel.
"""

from setuptools import find_namespace_packages, setup

# namespace discovery: data folders (resources/screenshots) count too, so their files ship as package data
ROOTS = {"shardscope.app": "app", "shardscope.backend": "backend", "shardscope.widgets": "widgets",
         "shardscope.resources": "resources"}
# app/package is the top-level ``shardscope`` package itself (see package-dir), not a subpackage of app
packages = ["shardscope"]
for name, folder in ROOTS.items():
    found = find_namespace_packages(folder, exclude=["package", "package.*", "*__pycache__*"])
    packages += [name, *(f"{name}.{sub}" for sub in found)]

setup(packages=packages)
