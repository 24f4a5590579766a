"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/audio/speech``, ``/v1/images/generations``.

Each reads an OpenAI request body, maps what M* can honour onto one Conductor.Generate call
and answers in OpenAI's shapes. A parameter M* cannot honour is a 400 naming it, never
ignored; a JSON ``null`` counts as absent, as OpenAI reads it.
"""
