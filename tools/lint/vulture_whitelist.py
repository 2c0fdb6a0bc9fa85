"""Names that vulture (`make lint`; settings in pyproject.toml, [tool.vulture]) counts as used.

Each is reached by a framework, a library or serialisation, not by code vulture can follow. vulture
matches names, not objects, so one line covers a name wherever it is defined. This file is read by
vulture only: it is not a package, nothing imports it and it never runs.
"""

from vulture.whitelists.whitelist_utils import Whitelist

_ = Whitelist()

# pytest reads the markers of a test module from its `pytestmark` global.
_.pytestmark

# Fields of the wire schemas (libs/collm_common/wire): set by keyword, read by the peer that decodes the
# message (and by the result files the benchmarks write from it).
_.in_flight_here  # GatewayReplicaView: this gateway's requests in flight on the replica
_.gain_diff_nats  # RoundOutcome: the promotion gate's paired test of the candidate
_.gain_se_nats
_.gain_examples

# Fields of the gateway's HTTP request models (OpenAI and vLLM compatible): accepted and validated as the
# clients send them, and part of the published OpenAPI schema.
_.load_inplace  # LoadLoraAdapterRequest (vLLM)
_.lora_int_id  # UnloadLoraAdapterRequest (vLLM)
_.tool_call_id  # ChatMessageIn: the call a tool turn answers
_.strict  # JsonSchemaIn, FunctionIn

# Fields of the benchmark's dataclasses that are written out whole (dataclasses.asdict, vars).
_.served_model  # RequestRecord, a column of requests.jsonl (tools/collm_bench/README.md)
_.measured_unix_s  # Calibration, when the file was measured (bench/calibration/*.json)
_.input_p50  # TraceStats, printed by `python -m collm_bench traces`
_.input_p99
_.output_mean
_.output_p99

# Hooks and attributes of the standard library that it reads or calls itself.
_.daemon_threads  # socketserver.ThreadingMixIn: request threads do not block the exit
_.log_message  # http.server.BaseHTTPRequestHandler / wsgiref: the access log, silenced
_.do_POST  # http.server.BaseHTTPRequestHandler: the POST handler
_.whitespace_split  # shlex.shlex: split on whitespace only
_._finalizer  # weakref.finalize kept by the object it cleans up after

# Attributes of third-party objects, set for the library to read.
_.should_exit  # uvicorn.Server: stop serving
_.force_exit  # uvicorn.Server: stop without waiting for connections
_.middleware_stack  # Starlette: the app's rebuilt middleware stack
_.pre_tokenizer  # tokenizers.Tokenizer
_.pad_token  # transformers tokenizer
_.base_model_name_or_path  # peft config, written into adapter_config.json
_._TRACER_PROVIDER_SET_ONCE  # opentelemetry.trace globals, reset so a later test may set a provider
_._TRACER_PROVIDER
