"""`tandem serve`: OpenAI-compatible HTTP endpoints (`app`) over a continuous-batching scheduler (`scheduler`)
that runs each request on its own Tandem cache; `sizing` says what a request's cache will hold before admission."""
