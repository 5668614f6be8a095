"""The one request pipeline, with no HTTP in it: a request's prompt (text, token ids or chat
messages), tools, response_format and sampling become the engine's requests, and every refusal on
the way is a RequestError naming the field at fault (errors.py).

Its steps, in the order both doors take them:
1. `shape.shape_of`: the tools and the response_format checked (shape.py);
2. `prompt.text_of` renders a chat as the model's template takes it; `prompt.bounded` tokenizes a
   text, refusing one past the context from a prefix; `prompt.given` checks token ids;
3. `shape.constraint_of`: the reply's grammar compiled;
4. `LLM.request`: the engine's request and its proposer, one per choice;
5. `text.TextAssembler`: the engine's token events of a request become text chunks (stop strings);
6. `reply.Reader` / `reply.read`: a chat's reply read into content, reasoning (harmony's analysis
   channel) and tool calls, as it streams or whole (`completion.completion` for the Python API);
   `reply.end_ids`: the tokens that end a generation (harmony's <|return|> and <|call|>, never <|end|>).
The Python API (api.py) runs them in a row; the server's routes (server/requests.py) run the same
functions where each belongs (tokenizing and compiling on their thread pools, a request's places in
the queue taken between), and answer a RequestError with a 400 carrying its param and code. So the
same request gets the same prompt ids, constraint and refusal through either door
(tests/test_one_pipeline.py).
"""
