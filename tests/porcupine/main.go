// Command linearize checks a history of lease-store calls for linearizability against a
// sequential model of the lease protocol, with Porcupine: the independent checker of
// tests/linearizability.rs, which records the history on a real server with clients killed
// mid-call. It shares no code with the store it checks.
//
//	linearize HISTORY.json [VISUALIZATION.html]
//
// Exit status 0: linearizable; 1: not linearizable (the visualization, when asked for, shows
// where); 2: bad input or the check timed out.
//
// The model (docs/store.md, "The lease protocol"), per target:
//   - acquire: "acquired" with a token above every token issued before (the fence), when no
//     live lease is held; "held" with the holder's owner while one is;
//   - renew: "renewed" only for the exact (lease id, owner, token) of the live lease; else "lost",
//     "expired" when no lease is live, "not_holder" when another one is;
//   - release: "released" only for the exact holder of the live lease (which then ends); else
//     "not_holder";
//   - check: "current" when the token is the newest issued, "stale" when a newer one exists,
//     both with that newest token.
//
// Time: a lease expires ttl after the server ran the call that granted or renewed it, which lies
// somewhere in that call's [call, return] window. Only calls change the state: an expiry is never
// recorded as "free" (a call placed later in the order may have run earlier in time), only as a
// tighter bound on when it happened (one clock: the recorder and the server share
// a machine). At another call's window the lease is certainly live, certainly expired, or
// either; "either" makes the model nondeterministic. A call whose client was killed may or
// may not have taken effect: it ends at its settle bound (the kill plus half a second, by which
// the server has run it or never will), and every outcome is allowed, "no effect" included. A
// token it may have issued is unknown: the fence is then only a lower bound until the next
// observed token. Only killed calls are unknown: the recorder fails any other call that did
// not answer (calls cut off by a failover are recorded as killed).
//
// Failover: a "failover" record (one per target, its window from the moment the replica was
// detached to the moment clients were switched to it and the old primary killed) promotes a
// replica that missed the newest writes. Its grants must still carry tokens above every token
// issued before (the token rule survives a stale server), but for a while the promoted server
// may hold what the model does not know: a lease it kept from before the failover (held,
// renewed and released by its holder until its TTL ran out: ghostUntil), and a fence below the
// newest token issued before (until its next grant: staleFence), so a check may see a lower
// newest token, or refuse a token it never saw (invalid_request).
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"time"

	"github.com/anishathalye/porcupine"
)

// Call is one recorded call, as tests/linearizability.rs writes it. Times are nanoseconds on
// the recorder's monotonic clock.
type Call struct {
	Client int    `json:"client"`
	Target string `json:"target"`
	Op     string `json:"op"`
	Lease  string `json:"lease"`
	Owner  string `json:"owner"`
	Token  uint64 `json:"token"`
	TTLMs  int64  `json:"ttl_ms"`
	Call   int64  `json:"call"`
	Return int64  `json:"return"`
	// Killed: the client was killed before it printed a reply (Out is then absent).
	Killed bool `json:"killed"`
	// Settle: a bound after which a killed or failed call has certainly run or never will (the
	// server runs what it received within milliseconds; the recorder allows half a second).
	Settle int64 `json:"settle"`
	// The reply the client printed (the CLI's JSON), if any.
	Out *Reply `json:"out"`
}

// Reply is the part of the CLI's JSON reply the model checks.
type Reply struct {
	Outcome string `json:"outcome"`
	Token   uint64 `json:"token"`
	Owner   string `json:"owner"`
	Reason  string `json:"reason"`
	Newest  uint64 `json:"newest"`
	// Kind: the error kind of an "error" outcome.
	Kind string `json:"kind"`
}

// A call's input to the model: the call itself (its window included).
type input = Call

// A call's output: the reply, or nil when unknown (killed, or failed in a way that may or may
// not have taken effect).
type output = *Reply

// The holder of a target. Token 0: issued to a killed client, value unknown. Expiry lies in
// [expLo, expHi] on the recorder's clock.
type holder struct {
	lease, owner string
	token        uint64
	expLo, expHi int64
}

// State of one target. Values, not pointers: Porcupine compares and copies them.
type state struct {
	// The newest token observed; fenceOpen: a larger one may have been issued since, unseen.
	fence     uint64
	fenceOpen bool
	held      bool
	h         holder
	// clock: the latest call among the calls placed so far. Calls are placed in the order they
	// took effect, so this one took effect no earlier than that (nor than its own call).
	clock int64
	// After a failover: a lease from before it may live on the promoted server until ghostUntil
	// (0: none can); the promoted server's fence may be below fence until its next grant.
	ghostUntil int64
	staleFence bool
}

// start: the earliest moment call c can have taken effect, placed after the calls before it.
func (s state) start(c input) int64 { return max(c.Call, s.clock) }

// liveness of the holder over a call's window: certainly live, certainly expired, or either.
func (s state) maybeLive(c input) bool    { return s.held && s.start(c) <= s.h.expHi }
func (s state) maybeExpired(c input) bool { return !s.held || c.Return >= s.h.expLo }

// expiredBy: the state after call c found the lease expired. Expiry is time, not an event:
// the holder stays (another call, concurrent but placed later, judges it by its own window),
// but it had certainly expired by the end of c.
func (s state) expiredBy(c input) state {
	if s.held && c.Return < s.h.expHi {
		s.h.expHi = c.Return
	}
	return s
}

// ghost: a lease from before a failover may still live on the promoted server at call c, and
// none granted since is certainly live (the server holds one lease per target).
func (s state) ghost(c input) bool {
	return s.ghostUntil > s.start(c) && s.maybeExpired(c)
}

func (s state) isHolder(c input) bool {
	return s.held && s.h.lease == c.Lease && s.h.owner == c.Owner && s.h.token != 0 && s.h.token == c.Token
}

// grantedBy: the holder a grant or renewal by call c, taking effect after start, leaves behind.
func grantedBy(c input, start int64, lease, owner string, token uint64) holder {
	ttl := c.TTLMs * int64(time.Millisecond)
	// The server keeps time in milliseconds: an expiry lands up to 1 ms after grant + ttl.
	hi := c.Return + ttl + int64(time.Millisecond)
	return holder{lease: lease, owner: owner, token: token, expLo: start + ttl, expHi: hi}
}

func step(st interface{}, in interface{}, out interface{}) []interface{} {
	s, c, r := st.(state), in.(input), out.(output)
	start := s.start(c)
	if start > c.Return {
		return nil
	}
	s.clock = start
	var next []interface{}
	possible := func(ok bool, n state) {
		if ok {
			next = append(next, n)
		}
	}
	free := s
	free.held = false
	if r == nil {
		// A killed call may never have reached the server.
		next = append(next, s)
	}
	switch c.Op {
	case "failover":
		// The promoted server may hold one lease the model lost track of, until every lease
		// granted or renewed before the switch has expired; tokens must stay above the fence.
		n := free
		n.ghostUntil = c.Return + c.TTLMs*int64(time.Millisecond) + 2*int64(time.Millisecond)
		n.staleFence = true
		next = []interface{}{n}
	case "acquire":
		// Re-entrant: the same lease id and owner get their token back.
		if s.maybeLive(c) && s.h.lease == c.Lease && s.h.owner == c.Owner {
			n := s
			n.h = grantedBy(c, start, c.Lease, c.Owner, s.h.token)
			possible(r == nil || (r.Outcome == "acquired" && r.Token == s.h.token), n)
		}
		if s.maybeLive(c) && !(s.h.lease == c.Lease && s.h.owner == c.Owner) {
			possible(r == nil || (r.Outcome == "held" && r.Owner == s.h.owner), s)
		}
		if s.maybeExpired(c) {
			if r == nil {
				n := free
				n.fenceOpen, n.held = true, true
				n.h = grantedBy(c, start, c.Lease, c.Owner, 0)
				next = append(next, n)
			} else if r.Outcome == "acquired" && r.Token > s.fence {
				n := free
				n.fence, n.fenceOpen, n.held = r.Token, false, true
				n.h = grantedBy(c, start, c.Lease, c.Owner, r.Token)
				// A grant: the server held no lease then, and its fence is this token.
				n.ghostUntil, n.staleFence = 0, false
				next = append(next, n)
			}
		}
		if s.ghost(c) {
			// Refused by a lease the promoted server kept from before the failover.
			possible(r == nil || r.Outcome == "held", s)
		}
	case "renew":
		if s.maybeLive(c) && s.isHolder(c) {
			n := s
			n.h = grantedBy(c, start, c.Lease, c.Owner, c.Token)
			possible(r == nil || r.Outcome == "renewed", n)
		}
		if s.maybeExpired(c) {
			possible(r == nil || (r.Outcome == "lost" && r.Reason == "expired"), s.expiredBy(c))
		}
		if s.maybeLive(c) && !s.isHolder(c) {
			possible(r == nil || (r.Outcome == "lost" && r.Reason == "not_holder"), s)
		}
		if s.ghost(c) && c.Token <= s.fence {
			// The lease the promoted server kept is this one (renewed: now tracked), or another.
			n := free
			n.held, n.ghostUntil = true, 0
			n.h = grantedBy(c, start, c.Lease, c.Owner, c.Token)
			possible(r == nil || r.Outcome == "renewed", n)
			possible(r == nil || r.Outcome == "lost", s)
		}
	case "release":
		if s.isHolder(c) {
			if s.maybeLive(c) {
				possible(r == nil || r.Outcome == "released", free)
			}
			// The holder itself refused: its lease had expired.
			if s.maybeExpired(c) {
				possible(r == nil || r.Outcome == "not_holder", s.expiredBy(c))
			}
		} else {
			possible(r == nil || r.Outcome == "not_holder", s)
		}
		if s.ghost(c) && c.Token <= s.fence {
			n := free
			n.ghostUntil = 0
			possible(r == nil || r.Outcome == "released", n)
			possible(r == nil || r.Outcome == "not_holder", s)
		}
	case "check":
		switch {
		case r == nil:
			// Read-only: the unknown outcome is the no-effect state already added.
		case r.Outcome == "current":
			possible(!s.fenceOpen && c.Token == s.fence && r.Newest == s.fence, s)
			// The promoted server's newest token is one it kept: at most the fence.
			possible(s.staleFence && c.Token == r.Newest && r.Newest <= s.fence, s)
		case r.Outcome == "error":
			// The promoted server never saw this token (issued after it was detached).
			possible(s.staleFence && r.Kind == "invalid_request" && c.Token <= s.fence, s)
		case r.Outcome == "stale":
			if s.fenceOpen {
				// The newest is the unseen token: above the fence; now it is seen.
				n := s
				n.fence, n.fenceOpen = r.Newest, false
				possible(c.Token <= s.fence && r.Newest > s.fence, n)
			} else {
				possible(c.Token < s.fence && r.Newest == s.fence, s)
			}
			possible(s.staleFence && c.Token < r.Newest && r.Newest <= s.fence, s)
		}
	}
	return next
}

func describe(in interface{}, out interface{}) string {
	c, r := in.(input), out.(output)
	what := fmt.Sprintf("%s(%s %s %s tok=%d)", c.Op, c.Target, c.Lease, c.Owner, c.Token)
	if r == nil {
		return what + " -> ?"
	}
	return fmt.Sprintf("%s -> %s %d %s%s", what, r.Outcome, r.Token+r.Newest, r.Owner, r.Reason)
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: linearize HISTORY.json [VISUALIZATION.html]")
		os.Exit(2)
	}
	data, err := os.ReadFile(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var calls []Call
	if err := json.Unmarshal(data, &calls); err != nil {
		fmt.Fprintln(os.Stderr, "history:", err)
		os.Exit(2)
	}
	var ops []porcupine.Operation
	unknown := 0
	for _, c := range calls {
		var out output = c.Out
		if c.Killed {
			// May have taken effect at any time between its call and its settle bound, or never.
			out, c.Return = nil, c.Settle
			unknown++
		} else if c.Out == nil || c.Out.Outcome == "" || (c.Out.Outcome == "error" && c.Op != "check") {
			fmt.Fprintf(os.Stderr, "history: call %+v was not killed and has no answer\n", c)
			os.Exit(2)
		}
		ops = append(ops, porcupine.Operation{ClientId: c.Client, Input: c, Call: c.Call, Output: out, Return: c.Return})
	}
	spec := porcupine.NondeterministicModel{
		Init: func() []interface{} { return []interface{}{state{}} },
		Step: step,
		Equal: func(a, b interface{}) bool {
			return a.(state) == b.(state)
		},
		Partition: func(history []porcupine.Operation) [][]porcupine.Operation {
			byTarget := map[string][]porcupine.Operation{}
			for _, op := range history {
				t := op.Input.(input).Target
				byTarget[t] = append(byTarget[t], op)
			}
			var keys []string
			for t := range byTarget {
				keys = append(keys, t)
			}
			sort.Strings(keys)
			var parts [][]porcupine.Operation
			for _, t := range keys {
				parts = append(parts, byTarget[t])
			}
			return parts
		},
		DescribeOperation: describe,
		DescribeState: func(st interface{}) string {
			s := st.(state)
			open := ""
			if s.fenceOpen {
				open = "+"
			}
			if !s.held {
				return fmt.Sprintf("free fence=%d%s", s.fence, open)
			}
			return fmt.Sprintf("held by %s/%s tok=%d fence=%d%s", s.h.owner, s.h.lease, s.h.token, s.fence, open)
		},
	}
	model := spec.ToModel()
	result, info := porcupine.CheckOperationsVerbose(model, ops, 120*time.Second)
	fmt.Printf("linearize: %d calls (%d with an unknown outcome), %s\n", len(ops), unknown, result)
	if result != porcupine.Ok && len(os.Args) > 2 {
		if err := porcupine.VisualizePath(model, info, os.Args[2]); err == nil {
			fmt.Printf("linearize: visualization in %s\n", os.Args[2])
		}
	}
	switch result {
	case porcupine.Ok:
		os.Exit(0)
	case porcupine.Illegal:
		os.Exit(1)
	default:
		os.Exit(2)
	}
}
