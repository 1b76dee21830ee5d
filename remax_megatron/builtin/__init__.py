"""Built-in tasks and models that need no downloads: the tiny default runs offline.

tasks      the ``arith`` task (single-digit addition, fixed train/eval split)
tokenizer  the character-level tokenizer of the tiny models
models     recipes, the build cache ($REMAX_CACHE) and the warm start of ``builtin:tiny-arith`` and
           ``builtin:tiny-arith-rm``; ``resolve_model`` turns ``builtin:<name>`` or a directory into a path
"""
