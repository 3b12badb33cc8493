"""Sphinx configuration: the user guide and the API reference (built by CI with -W, and its
examples run as doctests: `python -m sphinx -W -b doctest docs docs/_build/doctest`)."""
import simdnorm

project = "simdnorm"
author = "the simdnorm developers"
copyright = "2026, the simdnorm developers"
release = version = simdnorm.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.doctest"]
napoleon_google_docstring = False
napoleon_numpy_docstring = True
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the signatures and the numpydoc sections say it
exclude_patterns = ["_build", "*.md"]  # the developer notes (Markdown) are read on their own
html_theme = "alabaster"
# simdnorm.dask's examples run when Dask (and xarray) are installed, as with the test extra, and are
# skipped otherwise; its API reference builds either way (Dask mocked when absent).
try:
    import dask.array  # noqa: F401
    have_dask = True
except ImportError:
    have_dask = False
    autodoc_mock_imports = ["dask"]
try:
    import xarray  # noqa: F401
    have_xarray = True
except ImportError:
    have_xarray = False
doctest_global_setup = f"import numpy as np\nimport simdnorm\nhave_dask = {have_dask}\nhave_xarray = {have_xarray}"
