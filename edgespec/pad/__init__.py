"""PAD, pivot-aware verification (arXiv 2511.00351): a lossy, opt-in acceptance rule that keeps a
mismatching draft token unless a small classifier over the target's own state calls it a pivot
(a token after which the answer goes wrong).

- ``tasks``, ``scoring``: problems with exact answers (generated families, a user's JSONL) and
  the scorers that judge answers to them;
- ``rollouts``: continuations decoded many at a time in the target runner's slots;
- ``labels``: the labelling shards (rollouts from prefix + draft token vs prefix + target token);
- ``labelling``: making those labels with the target runner;
- ``classifier``: the network, its folder (fingerprint-checked) and ``pad_keep``;
- ``training``: training and validating the classifier on the labels.
"""
