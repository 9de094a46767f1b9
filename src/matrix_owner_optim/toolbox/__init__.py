"""The toolbox: the ``matrix-owner-optim`` commands and what only they use.

``cli`` (``train``, ``bench``, ``simulate``, ``plan``), the training loop, the embedded GPT and
arithmetic corpus, the stock-FSDP2 baselines, profiler byte counts, the loopback rank launcher
and the analytic simulator. The library (everything outside this package) never imports it;
it needs the ``cli`` extra (progress bar, plots) for the commands.
"""
