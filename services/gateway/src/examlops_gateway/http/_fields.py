"""The fields a virtual key's request may carry to the engine, per API (GOVERNANCE.md has the table).

Everything here is an OpenAI field or a documented vLLM 0.32 request field
(openai/{chat_completion,completion}/protocol.py) that only shapes sampling, output or the prompt
the gateway bounds by its bytes. Left out, deliberately: what steers the engine's scheduling,
caching or transport (`priority`, `request_id`, `session_id`, `kv_transfer_params`,
`ec_transfer_params`, `vllm_xargs`), what feeds the media pipeline past mediaguard
(`media_io_kwargs`, `mm_processor_kwargs`, `prompt_embeds`), a client's own Jinja template
(`chat_template`: it can expand the prompt past any bound), fields vLLM 0.32 ignores (`best_of`,
`max_completion_tokens` on completions, `guided_choice`, `guided_decoding_backend`,
`guided_whitespace_pattern`, OpenAI-only fields) and render-endpoint fields. Declared fields of the
request models (model, messages, prompt, stream, stream_options, max_tokens, max_completion_tokens
on chat, n, temperature, top_p; input, encoding_format, dimensions and user on embeddings) are
validated there and always forwarded.

Embeddings (vLLM 0.32 pooling/{base,embed}/protocol.py) forward what shapes the tokenized input
within its byte bound or the encoding of the vectors. Left out besides the scheduling fields above:
`padding` (`max_length` pads every input to the model's length, past the bound), chat-message
inputs and their template fields (`messages`, `chat_template`, ...), and `bytes` encodings.
"""

from __future__ import annotations

from typing import Final

_SAMPLING: Final = frozenset({
    # OpenAI
    "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "seed", "stop", "user", "response_format",
    # vLLM sampling parameters
    "top_k", "min_p", "repetition_penalty", "length_penalty", "use_beam_search", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "truncation_side", "allowed_token_ids", "bad_words", "prompt_logprobs",
    "logprob_token_ids", "watermarking", "repetition_detection", "thinking_token_budget", "stream_interval",
    # vLLM output and prompt options
    "structured_outputs", "add_special_tokens", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
    "echo",
    # vLLM's former structured-output fields, which the sglang engine translates
    "guided_json", "guided_regex", "guided_grammar",
})

CHAT_FIELDS: Final = _SAMPLING | frozenset({
    "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort", "include_reasoning",
    "add_generation_prompt", "continue_final_message", "documents", "chat_template_kwargs",
})

COMPLETION_FIELDS: Final = _SAMPLING | frozenset({"suffix"})

EMBEDDING_FIELDS: Final = frozenset({
    "truncate_prompt_tokens", "truncation_side", "add_special_tokens", "use_activation", "embed_dtype",
    "endianness", "cache_salt",
})
