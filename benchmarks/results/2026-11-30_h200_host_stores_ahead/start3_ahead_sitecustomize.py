# every admitted prompt's stores made ahead (the server's batch is at most 16)
import tandem.serve.scheduler as s

s.RESERVE_AHEAD = 16
