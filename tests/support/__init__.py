"""What the tests share: model and artifact factories, oracles and fixtures, one module per area.

- ``kernels``: registries of random names, compiled on the bundled tokenizers, for the kernel and compiler tests;
- ``trie``: walking a compiled trie by tool name;
- ``serve``: the small artifact, the tiny model and the reference decoders the engine is checked against;
- ``serve_http``: the HTTP and MCP endpoint on a tiny model, with a gate that holds the worker mid-step;
- ``encoders``: a made-up sentence encoder, standing in for all-MiniLM-L6-v2;
- ``train``: labelled queries and training-data directories for the small artifact;
- ``write_adapter_answers``: the script that records ``adapter_answers.json``, the held-out answers the shipped
  adapter must give (``test_default_adapter.py``).

Imported as ``support.<module>`` (pytest puts ``tests/`` on the path).
"""
