"""Bindings of fastattn into other libraries' model code.

- :mod:`fastattn.integrations.transformers`: an attention implementation for Hugging
  Face transformers (``attn_implementation="fastattn"``); needs ``fastattn[torch]``.

Each submodule imports its library when it is imported; ``import fastattn`` imports
none of them.
"""
