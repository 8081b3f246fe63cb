# The release, read by pyproject.toml's build (scikit-build-core's regex provider) and by _ext.py,
# whose FFI target names carry it.
__version__ = "0.1.0"
