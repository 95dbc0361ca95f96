"""Fine-tuning the capabilities model on the regenerated training data: LoRA adapters, small enough to commit.

- ``training_data``: the training data regenerated from the artifact (``tooltrie gen-data``);
- ``data``: reading ``tooltrie gen-data``'s directory and checking it against the artifact (hashes, trie paths);
- ``batches``: teacher-forced batches with the shared prompt prefix run once;
- ``loss``: the plain and trie losses on the answer tokens, and the validation scores;
- ``lora``: peft's LoRA layers (training only);
- ``trainer``: the seeded loop, its log and the adapter it writes;
- ``command``: ``tooltrie gen-data`` and ``tooltrie train``.

The adapter it writes is read and merged by ``tooltrie.serve.adapter`` (serving needs no training code).

Nothing heavy is imported here: ``tooltrie.cli`` imports ``tooltrie.train.command`` at start-up.
"""
