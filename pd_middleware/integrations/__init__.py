"""Engine integrations: thin adapters that route an engine's PD paths through the middleware.

- :mod:`pd_middleware.integrations.sglang`: SGLang's PD decode first draft input
  (``build_eagle_disagg_draft_input``) and, on the prefill, the publisher hook. See
  ``docs/sglang.md``.

Importing this package imports no engine; each adapter imports its engine lazily, at
:func:`install` time.
"""

from __future__ import annotations
