"""Sphinx configuration of dpool's documentation site: ``python -m sphinx -W --keep-going docs docs/_build/html``."""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "dpool"
author = "the dpool authors"
copyright = "the dpool authors, BSD-3-Clause"
release = __import__("dpool").__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "screenshots"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"dpool {release}"
html_static_path: list = []


def setup(app):  # the CLI's help, read from its parser (nothing to keep in sync by hand)
    from docutils import nodes
    from docutils.parsers.rst import Directive

    class DpoolCli(Directive):
        def run(self):
            from dpool_workers.cli import parser

            top = parser()
            blocks = [top.format_help()]
            for action in top._subparsers._group_actions:
                for name, sub in action.choices.items():
                    blocks.append(f"$ dpool-workers {name} --help\n{sub.format_help()}")
            return [nodes.literal_block(text="\n".join(blocks))]

    app.add_directive("dpool-cli", DpoolCli)
