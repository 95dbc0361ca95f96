"""Evaluation: score a model and an artifact on labelled queries through the contract, per arm.

- ``datasets``: the bundled labelled sets (MetaTool, BFCL) with fixed splits, and user JSONL files;
- ``backends``: the arms: the engine, the transformers logits processor, unconstrained generation, an XGrammar
  grammar, retrieval (``tooltrie.retrieval``) and vLLM;
- ``harness``, ``scoring``: the run over a split and its scores (exact set, top-1, validity);
- ``results``: ``results.json`` (settings and scores) and ``answers.jsonl`` (one line per query), written and read;
- ``report``: those files, ``report.md`` and plots;
- ``compare``: two arms answer by answer (``tooltrie compare``);
- ``cli``: ``tooltrie eval`` and ``tooltrie grammar``.
"""
