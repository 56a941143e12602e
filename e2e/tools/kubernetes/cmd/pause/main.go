// Command pause is the e2e node's sandbox ("pause") image and the long-running process of
// its test pods: it prints one line, then sleeps until SIGTERM or SIGINT and exits 0. As a
// pod's PID 1 it also reaps any child that gets re-parented to it (no zombies pile up).
// Static, standard library only; nothing is ever pulled from a registry.
//
//	pause            wait for SIGTERM/SIGINT
//	pause -v         print the version and exit
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

const version = "targetlease-e2e-pause 1"

func main() {
	if len(os.Args) > 1 && (os.Args[1] == "-v" || os.Args[1] == "--version") {
		fmt.Println(version)
		return
	}
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	host, _ := os.Hostname()
	fmt.Printf("%s: pid %d uid %d on %s, waiting for SIGTERM\n", version, os.Getpid(), os.Getuid(), host)
	for sig := range sigs {
		if sig == syscall.SIGCHLD {
			reap()
			continue
		}
		fmt.Printf("%s: %v, exiting\n", version, sig)
		return
	}
}

// reap collects every exited child without blocking.
func reap() {
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
		if pid <= 0 || err != nil {
			return
		}
	}
}
