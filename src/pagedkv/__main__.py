"""``python -m pagedkv`` is the ``pagedkv`` command."""
from .cli import main

raise SystemExit(main())
