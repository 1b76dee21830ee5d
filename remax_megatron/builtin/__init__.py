"""Built-in tasks and models that need no downloads: the tiny default runs offline.

tasks      ``arith`` (single-digit addition) and ``multiply`` (two-digit products, the agent's task)
tokenizer  the character-level tokenizer of the tiny models (and its tool-using variant)
models     recipes, the build cache ($REMAX_CACHE) and the warm starts of ``builtin:tiny-arith``,
           ``builtin:tiny-arith-moe``, ``builtin:tiny-arith-rm`` and ``builtin:tiny-agent``; ``resolve_model``
           turns ``builtin:<name>`` or a directory into a path
agent      the warm start of ``builtin:tiny-agent``: it calls builtin:calculator a quarter of the time
"""
