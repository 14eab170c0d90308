"""``tandem bench``: load generators that measure a running OpenAI-compatible server.

``tandem bench serve`` (module :mod:`tandem.bench.serve`) plays the part of ``vllm bench
serve``: it sends streamed completion or chat requests at a chosen arrival rate and
concurrency, times every streamed chunk, and reports throughput and latency (TTFT, TPOT,
ITL, end-to-end) with percentiles and SLO goodput. It speaks only the public HTTP protocol,
so the same numbers can be taken from tandem, vLLM or SGLang and compared.

The modules are split so that the pure parts (datasets parsing, arrival schedules, metrics)
can be tested without a network or a server:

- :mod:`tandem.bench.records`  - what one request's measurement looks like
- :mod:`tandem.bench.datasets` - random and file (ShareGPT / prompt+output_len) workloads
- :mod:`tandem.bench.tokenizers` - token counting through a local tokenizer or the server
- :mod:`tandem.bench.client`   - one streamed HTTP request, timed chunk by chunk
- :mod:`tandem.bench.arrivals` - when each request is sent (Poisson, gamma, fixed, burst)
- :mod:`tandem.bench.metrics`  - aggregate numbers from the records (pure functions)
- :mod:`tandem.bench.plots`    - PNG charts (matplotlib, imported only when asked for)
- :mod:`tandem.bench.serve`    - the runner and its command line
"""
