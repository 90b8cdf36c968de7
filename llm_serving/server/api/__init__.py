"""The APIs' request bodies, one module per API, as pydantic models: every rule about a request's shape (types,
ranges, fields that exclude or need each other, names that must be unique or present) is a field or a validator
there, checked once (`base.validate`); each model's `to_request()` translates it into the one internal request
(server/translate.py), where what needs the served model is applied. `document.openapi` builds GET /openapi.json
from the same models.

- base.py: the strict body base, `validate` (a ValidationError naming the field, in the API's words), the JSON body
  reader, and the field types several APIs share (stop strings)
- openai.py: OpenAI's completions and chat (with vLLM's extra fields), vLLM's tokenize/detokenize and LoRA routes
- tgi.py: llm-serving's / TGI's generate
- embeddings.py: OpenAI's embeddings, the Jina/Cohere rerank, vLLM's score
- document.py: the OpenAPI document
"""
