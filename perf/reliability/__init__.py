"""Nothing lost under abuse: bad requests fuzzed over HTTP and gRPC (`fuzz`), a long run checked
for lost, duplicated or wrong answers and memory drift (`soak`), and overload with admission
(`overload`)."""
