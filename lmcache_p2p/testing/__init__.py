"""Test and benchmark scaffolding, kept out of the product's namespace.

* :mod:`.standin`: a CPU stand-in engine rank (paged KV of a real model's shape, the real
  CacheEngine on top) driven over JSON lines, with fault-injection ops (``corrupt``);
* :mod:`.offline_driver`: vLLM's ``LLM`` with the connector in one process, same JSON lines;
* :mod:`.jsonlines`: the JSON-lines process protocol both speak;
* :mod:`.tiny_model`: a deterministic tiny Llama and its tokenizer (tests, demo, benchmarks);
* :mod:`.pd_proxy`: vLLM's NIXL prefill/decode flow as a function and a small proxy server
  (a request to the prefill engine for one token, then to the decode engine with its
  ``kv_transfer_params``).
"""
