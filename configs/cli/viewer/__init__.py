"""toolgym.configs.cli.viewer: `toolgym view`'s trace viewer.

Modules (import them directly):
- index: a recording read tolerantly into a light per-episode index (filters, sorting, pages,
  comparison by task seed) and one episode's per-token view.
- server: a local web page (stdlib HTTP server; the page's scripts ship in `static/`, nothing is
  fetched from elsewhere).
"""
