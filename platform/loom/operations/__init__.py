"""What operators watch: GET /metrics for Prometheus, the last pass of periodic jobs, structured logs."""
