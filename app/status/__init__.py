"""The MQTT status channel (`monitoring.mqtt`): what a run and its nodes are doing, for people and
tools that watch (the live page, app/live/; a dashboard; an alerting bot), beside Flower's gRPC,
which carries the models. Topics and payloads: app/status/schema.py and docs/monitoring.md."""
