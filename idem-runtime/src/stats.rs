//! Table statistics for dashboards and health checks (to be written).
