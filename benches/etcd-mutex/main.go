// The baseline of the etcd benchmark (benches/etcd.rs): etcd's own lock,
// go.etcd.io/etcd/client/v3/concurrency's Mutex, as a Go service uses it. Each of -tasks
// goroutines locks and unlocks a mutex of its own (its own key prefix, so no task waits for
// another, as targetlease's tasks each claim a target of their own) on one session (one etcd
// lease, kept alive in the background) for -seconds after -warmup, and prints one JSON line:
// the cycles done and the latency quantiles of one lock+unlock cycle in microseconds.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"
)

func main() {
	endpoints := flag.String("endpoints", "", "comma-separated client URLs")
	tasks := flag.Int("tasks", 1, "concurrent lockers")
	seconds := flag.Float64("seconds", 1, "measured seconds")
	warmup := flag.Float64("warmup", 0.2, "unmeasured seconds before the measurement")
	prefix := flag.String("prefix", "/mutex-bench", "key prefix")
	flag.Parse()
	client, err := clientv3.New(clientv3.Config{
		Endpoints:   strings.Split(*endpoints, ","),
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "connect:", err)
		os.Exit(1)
	}
	defer client.Close()
	session, err := concurrency.NewSession(client, concurrency.WithTTL(30))
	if err != nil {
		fmt.Fprintln(os.Stderr, "session:", err)
		os.Exit(1)
	}
	defer session.Close()
	start := time.Now()
	measureFrom := start.Add(time.Duration(*warmup * float64(time.Second)))
	until := measureFrom.Add(time.Duration(*seconds * float64(time.Second)))
	var mu sync.Mutex
	var latencies []float64
	var failed error
	var wg sync.WaitGroup
	for t := 0; t < *tasks; t++ {
		wg.Add(1)
		go func(t int) {
			defer wg.Done()
			m := concurrency.NewMutex(session, fmt.Sprintf("%s/%d", *prefix, t))
			ctx := context.Background()
			var mine []float64
			for {
				began := time.Now()
				if !began.Before(until) {
					break
				}
				if err := m.Lock(ctx); err != nil {
					mu.Lock()
					failed = err
					mu.Unlock()
					return
				}
				if err := m.Unlock(ctx); err != nil {
					mu.Lock()
					failed = err
					mu.Unlock()
					return
				}
				if !began.Before(measureFrom) && time.Now().Before(until) {
					mine = append(mine, float64(time.Since(began).Microseconds()))
				}
			}
			mu.Lock()
			latencies = append(latencies, mine...)
			mu.Unlock()
		}(t)
	}
	wg.Wait()
	if failed != nil {
		fmt.Fprintln(os.Stderr, "lock or unlock:", failed)
		os.Exit(1)
	}
	sort.Float64s(latencies)
	q := func(p float64) float64 {
		if len(latencies) == 0 {
			return 0
		}
		return latencies[int(p*float64(len(latencies)-1))]
	}
	out, _ := json.Marshal(map[string]any{
		"cycles": len(latencies),
		"p50_us": q(0.5),
		"p99_us": q(0.99),
	})
	fmt.Println(string(out))
}
