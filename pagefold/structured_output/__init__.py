"""Structured output (guided decoding) with xgrammar.

* :class:`StructuredOutputsParams` (``params.py``): what a request constrains its output to --
  a JSON schema, any JSON object, a regex, one of a list of choices, or an EBNF grammar; a
  field of :class:`~pagefold.sampling_params.SamplingParams`;
* :class:`GrammarCompiler` (``backend.py``): compiles a constraint once per distinct
  constraint (LRU cache) against the model's vocabulary; a constraint xgrammar cannot compile
  is a ``ValueError`` that says why (the server answers 400);
* :class:`StructuredOutputManager` (``manager.py``): lives in the EngineCore; one matcher per
  request, advanced with each accepted token, rolled back on rejected draft tokens; fills one
  packed token bitmask for the whole batch per step, which the sampler applies before
  anything else (:func:`apply_token_bitmask`).
"""

from pagefold.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
