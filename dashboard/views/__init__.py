"""The dashboard's pages: each module has a ``render()`` that draws one page."""
