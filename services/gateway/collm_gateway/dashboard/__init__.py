"""The live dashboard served by the gateway at `/dashboard`.

* `state`: the pure core. It folds NATS messages (replica telemetry, coordinator decisions and status,
  round events) and adapter records read from the store into a bounded dashboard state, and renders it
  as JSON view models: a snapshot per viewer, and updates tagged with who may see them.
* `hub`: the I/O shell. It subscribes to the subjects, reads the adapter store, asks the aggregator for
  its round records and the coordinator for its status, and fans updates out to connected streams.
* `routes`: `GET /dashboard` (the page), `GET /dashboard/state` (a snapshot as JSON) and
  `GET /dashboard/events` (server-sent events: a snapshot, then updates), with the API key taken from
  the `Authorization` header, the `key` query parameter or the dashboard's cookie.
* `static/index.html`: the page itself (plain HTML, CSS and JavaScript; charts are inline SVG).
"""
