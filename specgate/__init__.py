"""The composition root: the ``specgate`` command and ``specgate up``, the only code that imports every part."""
