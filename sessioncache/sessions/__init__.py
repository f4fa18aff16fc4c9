"""Agent sessions: the manager (sliding TTLs, chain pins, heads), each session's return
forecast, the dashboard's query over them and the background sweep that expires them."""
