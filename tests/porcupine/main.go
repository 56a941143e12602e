// Command linearize checks a history of lease-store calls for linearizability against a
// sequential model of the lease protocol, with Porcupine: the independent checker of
// tests/store/linearizability.rs, which records the history on a real server with clients killed
// mid-call. It shares no code with the store it checks.
//
//	linearize HISTORY.json [VISUALIZATION.html]
//
// Exit status 0: linearizable; 1: not linearizable (the visualization, when asked for, shows
// where); 2: bad input or the check timed out (after LINEARIZE_TIMEOUT, a Go duration; 2m unless
// set).
//
// The model (docs/internals/store.md, "The protocol"), per target with permits N (1: the exclusive
// lease), each permit a slot 0 to N-1 with its own lease and fence:
//   - acquire: "acquired" in the lowest slot that is free (never held, released or expired), with
//     a token above every token issued on the target in any slot; the claim's own live lease
//     (same lease id and owner) again, in its slot with its token; "held" naming a live holder
//     while every slot is held (for N = 1, while slot 0 is someone else's);
//     "permits_conflict" naming the value in force while a permit granted under another
//     permits value may be held, or the value the target keeps for as long as such a permit
//     may be, whichever claim asks;
//   - renew: "renewed" only for the exact (lease id, owner, token) of the live lease of the
//     handle's slot; else "lost", "expired" when that slot has no live lease, "not_holder" when
//     another one holds it;
//   - release: "released" only for the exact holder of the slot's live lease (which then ends,
//     with the permits value kept once no other permit may be held); else "not_holder";
//   - check: against the asked slot's fence, "current" when the token is the slot's newest,
//     "stale" when a newer one was granted in the slot, both with that newest token; a token
//     above it was never granted in the slot and is refused (invalid_request).
//
// Time: a lease expires ttl after the server ran the call that granted or renewed it, which lies
// somewhere in that call's [call, return] window. Only calls change the state: an expiry is
// never recorded as "free" (a call placed later in the order may have run earlier in time), only
// as a tighter bound on when it happened (one clock: the recorder and the server share a
// machine). At another call's window each slot's lease (and the permits value the target keeps)
// is certainly live, certainly expired, or either; "either" makes the model nondeterministic: an
// acquire is judged in every assignment the window allows. A call whose client was killed may or
// may not have taken effect: it ends at its settle bound (the kill plus half a second, by which
// the server has run it or never will), and every outcome is allowed, "no effect" included. A
// token it may have issued is unknown: the slot's fence and the target's newest token are then
// only lower bounds until a check of the slot sees it or the next observed grant. Only killed
// calls are unknown: the recorder fails any other call that did not answer (calls cut off by a
// failover are recorded as killed).
//
// Failover (exclusive leases only): a "failover" record (one per target, its window from the
// moment the replica was detached to the moment clients were switched to it and the old primary
// killed) promotes a replica that missed the newest writes. Its grants must still carry tokens
// above every token issued before (the token rule survives a stale server), but for a while the
// promoted server may hold what the model does not know: a lease it kept from before the
// failover (held, renewed and released by its holder until its TTL ran out: ghostUntil), and a
// fence below the newest token issued before (until its next grant: staleFence), so a check may
// see a lower newest token, or refuse a token it never saw (invalid_request).
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"time"

	"github.com/anishathalye/porcupine"
)

// maxSlots: the most permits a history may ask. The state keeps the slots in a fixed array, so
// that Porcupine can compare states with ==.
const maxSlots = 4

// Call is one recorded call, as tests/store/linearizability.rs writes it. Times are nanoseconds on
// the recorder's monotonic clock.
type Call struct {
	Client int    `json:"client"`
	Target string `json:"target"`
	Op     string `json:"op"`
	Lease  string `json:"lease"`
	Owner  string `json:"owner"`
	Token  uint64 `json:"token"`
	TTLMs  int64  `json:"ttl_ms"`
	// Permits: the permits value an acquire asks, or the one a renewed or released lease was
	// granted under; absent (0) means 1, the exclusive lease.
	Permits int `json:"permits"`
	// Slot: the slot of a renewed or released lease, or whose fence a check asks about.
	Slot   int   `json:"slot"`
	Call   int64 `json:"call"`
	Return int64 `json:"return"`
	// Killed: the client was killed before it printed a reply (Out is then absent).
	Killed bool `json:"killed"`
	// Settle: a bound after which a killed or failed call has certainly run or never will (the
	// server runs what it received within milliseconds; the recorder allows half a second).
	Settle int64 `json:"settle"`
	// The reply the client printed (the CLI's JSON), if any.
	Out *Reply `json:"out"`
}

// permits: the permits value of the call (1 when the history does not say).
func (c Call) permits() int {
	if c.Permits < 1 {
		return 1
	}
	return c.Permits
}

// Reply is the part of the CLI's JSON reply the model checks.
type Reply struct {
	Outcome string `json:"outcome"`
	Token   uint64 `json:"token"`
	// Slot: the slot an acquire granted.
	Slot   int    `json:"slot"`
	Owner  string `json:"owner"`
	Reason string `json:"reason"`
	Newest uint64 `json:"newest"`
	// InForce: the permits value a permits_conflict refusal names.
	InForce int `json:"inForce"`
	// Kind: the error kind of an "error" outcome.
	Kind string `json:"kind"`
}

// A call's input to the model: the call itself (its window included).
type input = Call

// A call's output: the reply, or nil when unknown (killed, or failed in a way that may or may
// not have taken effect).
type output = *Reply

// The holder of a slot. Token 0: issued to a killed client, value unknown. Expiry lies in
// [expLo, expHi] on the recorder's clock.
type holder struct {
	lease, owner string
	token        uint64
	// permits: the permits value the lease was granted under.
	permits      int
	expLo, expHi int64
}

// One slot of a target: its holder, if any, and its fence (the newest token granted in it;
// fenceOpen: that grant went to a killed client, so its value is unknown, above fence).
type slot struct {
	held      bool
	h         holder
	fence     uint64
	fenceOpen bool
}

// State of one target. Values, not pointers: Porcupine compares and copies them.
type state struct {
	// The newest token observed in any slot; topOpen: a larger one may have been issued since,
	// unseen.
	top     uint64
	topOpen bool
	slots   [maxSlots]slot
	// inForce: the permits value (above 1) the target keeps while a permit granted under it
	// may be held, until somewhere in [inLo, inHi] or until the last such permit is released;
	// 0 when none is kept. A claim asking another value is refused while it stands.
	inForce    int
	inLo, inHi int64
	// clock: the latest call among the calls placed so far. Calls are placed in the order they
	// took effect, so this one took effect no earlier than that (nor than its own call).
	clock int64
	// After a failover (exclusive leases only): a lease from before it may live on the promoted
	// server until ghostUntil (0: none can); the promoted server's fence may be below top until
	// its next grant.
	ghostUntil int64
	staleFence bool
}

// start: the earliest moment call c can have taken effect, placed after the calls before it.
func (s state) start(c input) int64 { return max(c.Call, s.clock) }

// liveness of slot i's holder over a call's window: certainly live, certainly expired, or
// either.
func (s state) maybeLive(i int, c input) bool {
	return s.slots[i].held && s.start(c) <= s.slots[i].h.expHi
}
func (s state) maybeExpired(i int, c input) bool {
	return !s.slots[i].held || c.Return >= s.slots[i].h.expLo
}

// expiredBy: the state after call c found slot i's lease expired. Expiry is time, not an event:
// the holder stays (another call, concurrent but placed later, judges it by its own window),
// but it had certainly expired by the end of c.
func (s state) expiredBy(i int, c input) state {
	if s.slots[i].held && c.Return < s.slots[i].h.expHi {
		s.slots[i].h.expHi = c.Return
	}
	return s
}

// The permits value kept for the target, as for a slot's lease: it may stand or be gone at c.
func (s state) inForceMaybe(c input) bool { return s.inForce != 0 && s.start(c) <= s.inHi }
func (s state) inForceMaybeGone(c input) bool {
	return s.inForce == 0 || c.Return >= s.inLo
}
func (s state) inForceGoneBy(c input) state {
	if s.inForce != 0 && c.Return < s.inHi {
		s.inHi = c.Return
	}
	return s
}

// keepPermits: a grant or renewal under permits above 1, taking effect after start, keeps the
// value in force for at least the call's TTL from then (never shorter than it was).
func (s state) keepPermits(c input, start int64, permits int) state {
	if permits < 2 {
		return s
	}
	ttl := c.TTLMs * int64(time.Millisecond)
	lo, hi := start+ttl, c.Return+ttl+int64(time.Millisecond)
	if s.inForce != 0 {
		if !s.inForceMaybeGone(c) {
			lo = max(lo, s.inLo)
		}
		hi = max(hi, s.inHi)
	}
	s.inForce, s.inLo, s.inHi = permits, lo, hi
	return s
}

// ghost: a lease from before a failover may still live on the promoted server at call c, and
// none granted since is certainly live (the server holds one exclusive lease per target).
func (s state) ghost(c input) bool {
	return s.ghostUntil > s.start(c) && s.maybeExpired(0, c)
}

// isHolder: c names slot i's lease exactly (lease id, owner and token).
func (s state) isHolder(i int, c input) bool {
	h := s.slots[i].h
	return s.slots[i].held && h.lease == c.Lease && h.owner == c.Owner && h.token != 0 && h.token == c.Token
}

// grantedBy: the holder a grant or renewal by call c, taking effect after start, leaves behind.
func grantedBy(c input, start int64, lease, owner string, token uint64, permits int) holder {
	ttl := c.TTLMs * int64(time.Millisecond)
	// The server keeps time in milliseconds: an expiry lands up to 1 ms after grant + ttl.
	hi := c.Return + ttl + int64(time.Millisecond)
	return holder{lease: lease, owner: owner, token: token, permits: permits, expLo: start + ttl, expHi: hi}
}

// A world: which of the slots an acquire reads are live when it runs, and whether the permits
// value in force still stands; n is the state narrowed to agree.
type world struct {
	live    [maxSlots]bool
	inForce bool
	n       state
}

// worlds: every assignment of live or expired to the holders of slots 0 to permits-1, and of
// standing or gone to the permits value in force, that call c's window allows.
func (s state) worlds(c input, permits int) []world {
	ws := []world{{n: s}}
	for i := 0; i < permits; i++ {
		if !s.slots[i].held {
			continue
		}
		var next []world
		for _, w := range ws {
			if s.maybeLive(i, c) {
				l := w
				l.live[i] = true
				next = append(next, l)
			}
			if s.maybeExpired(i, c) {
				e := w
				e.n = e.n.expiredBy(i, c)
				next = append(next, e)
			}
		}
		ws = next
	}
	var next []world
	for _, w := range ws {
		if s.inForceMaybe(c) {
			p := w
			p.inForce = true
			next = append(next, p)
		}
		if s.inForceMaybeGone(c) {
			g := w
			g.n = g.n.inForceGoneBy(c)
			next = append(next, g)
		}
	}
	return next
}

// acquire: the states an acquire by c can leave, answering r. In each world: a live holder
// granted under another permits value refuses it (permits_conflict, naming that value); an
// exclusive claim is refused by a live holder (held); a standing permits value other than the
// asked one refuses it; the claim's own live lease is granted again (same slot and token); no
// free slot refuses it (held, naming a live holder); else the lowest free slot is granted, with
// a token above every token issued on the target in any slot.
func acquire(s state, c input, r output, start int64) []interface{} {
	var next []interface{}
	possible := func(ok bool, n state) {
		if ok {
			next = append(next, n)
		}
	}
	p := c.permits()
	for _, w := range s.worlds(c, p) {
		n := w.n
		mine, free := -1, -1
		var conflicts []int
		var others []string
		for i := 0; i < p; i++ {
			if !w.live[i] {
				if free < 0 {
					free = i
				}
				continue
			}
			h := n.slots[i].h
			if h.permits != p {
				conflicts = append(conflicts, h.permits)
			}
			if h.lease == c.Lease && h.owner == c.Owner {
				mine = i
			} else {
				others = append(others, h.owner)
			}
		}
		if len(conflicts) > 0 {
			possible(r == nil || (r.Outcome == "permits_conflict" && contains(conflicts, r.InForce)), n)
			continue
		}
		if p == 1 && len(others) > 0 {
			possible(r == nil || (r.Outcome == "held" && r.Owner == others[0]), n)
			continue
		}
		if w.inForce && n.inForce != p {
			possible(r == nil || (r.Outcome == "permits_conflict" && r.InForce == n.inForce), n)
			continue
		}
		if !w.inForce {
			// Gone: a grant below writes it anew.
			n.inForce = 0
		}
		if mine >= 0 {
			// Re-entrant: the same lease id and owner get their slot and token back.
			m := n.keepPermits(c, start, p)
			h := m.slots[mine].h
			m.slots[mine].h = grantedBy(c, start, h.lease, h.owner, h.token, h.permits)
			possible(r == nil || (r.Outcome == "acquired" && r.Token == h.token && h.token != 0 && r.Slot == mine), m)
			continue
		}
		if free < 0 {
			possible(r == nil || (r.Outcome == "held" && contains(others, r.Owner)), w.n)
			continue
		}
		g := n.keepPermits(c, start, p)
		if r == nil {
			g.topOpen = true
			g.slots[free] = slot{held: true, h: grantedBy(c, start, c.Lease, c.Owner, 0, p), fence: g.slots[free].fence, fenceOpen: true}
			next = append(next, g)
		} else if r.Outcome == "acquired" && r.Slot == free && r.Token > s.top {
			g.top, g.topOpen = r.Token, false
			g.slots[free] = slot{held: true, h: grantedBy(c, start, c.Lease, c.Owner, r.Token, p), fence: r.Token}
			// A grant: the server held no lease then, and its fence is this token.
			g.ghostUntil, g.staleFence = 0, false
			next = append(next, g)
		}
	}
	if p == 1 && s.ghost(c) {
		// Refused by a lease the promoted server kept from before the failover.
		possible(r == nil || r.Outcome == "held", s)
	}
	return next
}

func contains[T comparable](xs []T, x T) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

// normal: the state with what no later call can tell apart dropped, so that Porcupine sees equal
// states as equal. Every later call starts at clock or after: a lease (or permits value) whose
// expiry bound lies before it is gone for all of them, as if never held.
func (s state) normal() state {
	for i := range s.slots {
		if s.slots[i].held && s.slots[i].h.expHi < s.clock {
			s.slots[i].held, s.slots[i].h = false, holder{}
		}
	}
	if s.inForce != 0 && s.inHi < s.clock {
		s.inForce, s.inLo, s.inHi = 0, 0, 0
	}
	if s.ghostUntil != 0 && s.ghostUntil <= s.clock {
		s.ghostUntil = 0
	}
	return s
}

func step(st interface{}, in interface{}, out interface{}) []interface{} {
	next := transitions(st, in, out)
	for i, n := range next {
		next[i] = n.(state).normal()
	}
	return next
}

func transitions(st interface{}, in interface{}, out interface{}) []interface{} {
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
	if r == nil {
		// A killed call may never have reached the server.
		next = append(next, s)
	}
	i := c.Slot
	switch c.Op {
	case "failover":
		// The promoted server may hold one lease the model lost track of, until every lease
		// granted or renewed before the switch has expired; tokens must stay above the fence.
		n := s
		for j := range n.slots {
			n.slots[j].held = false
		}
		n.inForce = 0
		n.ghostUntil = c.Return + c.TTLMs*int64(time.Millisecond) + 2*int64(time.Millisecond)
		n.staleFence = true
		next = []interface{}{n}
	case "acquire":
		next = append(next, acquire(s, c, r, start)...)
	case "renew":
		if s.maybeLive(i, c) && s.isHolder(i, c) {
			n := s.keepPermits(c, start, s.slots[i].h.permits)
			n.slots[i].h = grantedBy(c, start, c.Lease, c.Owner, c.Token, s.slots[i].h.permits)
			possible(r == nil || r.Outcome == "renewed", n)
		}
		if s.maybeExpired(i, c) {
			possible(r == nil || (r.Outcome == "lost" && r.Reason == "expired"), s.expiredBy(i, c))
		}
		if s.maybeLive(i, c) && !s.isHolder(i, c) {
			possible(r == nil || (r.Outcome == "lost" && r.Reason == "not_holder"), s)
		}
		if i == 0 && c.permits() == 1 && s.ghost(c) && c.Token <= s.top {
			// The lease the promoted server kept is this one (renewed: now tracked), or another.
			n := s
			n.slots[0].held, n.ghostUntil = true, 0
			n.slots[0].h = grantedBy(c, start, c.Lease, c.Owner, c.Token, 1)
			possible(r == nil || r.Outcome == "renewed", n)
			possible(r == nil || r.Outcome == "lost", s)
		}
	case "release":
		if s.isHolder(i, c) {
			if s.maybeLive(i, c) {
				n := s
				n.slots[i].held = false
				if hp := s.slots[i].h.permits; hp > 1 {
					// The permits value in force goes with the last permit released under it.
					last, someLive := n, false
					gone := true
					for j := 0; j < hp; j++ {
						if j == i {
							continue
						}
						someLive = someLive || s.maybeLive(j, c)
						gone = gone && s.maybeExpired(j, c)
						last = last.expiredBy(j, c)
					}
					last.inForce = 0
					possible(gone && (r == nil || r.Outcome == "released"), last)
					possible(someLive && (r == nil || r.Outcome == "released"), n)
				} else {
					possible(r == nil || r.Outcome == "released", n)
				}
			}
			// The holder itself refused: its lease had expired.
			if s.maybeExpired(i, c) {
				possible(r == nil || r.Outcome == "not_holder", s.expiredBy(i, c))
			}
		} else {
			possible(r == nil || r.Outcome == "not_holder", s)
		}
		if i == 0 && c.permits() == 1 && s.ghost(c) && c.Token <= s.top {
			n := s
			n.slots[0].held = false
			n.ghostUntil = 0
			possible(r == nil || r.Outcome == "released", n)
			possible(r == nil || r.Outcome == "not_holder", s)
		}
	case "check":
		// Against the fence of the asked slot: the newest token granted in that slot.
		sl := s.slots[i]
		switch {
		case r == nil:
			// Read-only: the unknown outcome is the no-effect state already added.
		case r.Outcome == "current":
			possible(!sl.fenceOpen && c.Token == sl.fence && r.Newest == sl.fence, s)
			// The promoted server's newest token is one it kept: at most the fence.
			possible(s.staleFence && c.Token == r.Newest && r.Newest <= s.top, s)
		case r.Outcome == "error":
			// A token above the slot's newest was never granted in that slot.
			possible(r.Kind == "invalid_request" && c.Token > sl.fence, s)
			// The promoted server never saw this token (issued after it was detached).
			possible(s.staleFence && r.Kind == "invalid_request" && c.Token <= s.top, s)
		case r.Outcome == "stale":
			if sl.fenceOpen {
				// The newest is the unseen token: above the slot's fence, at most the target's
				// newest when that is known; now it is seen.
				n := s
				n.slots[i].fence, n.slots[i].fenceOpen = r.Newest, false
				n.top = max(n.top, r.Newest)
				possible(c.Token < r.Newest && r.Newest > sl.fence && (s.topOpen || r.Newest <= s.top), n)
			} else {
				possible(c.Token < sl.fence && r.Newest == sl.fence, s)
			}
			possible(s.staleFence && c.Token < r.Newest && r.Newest <= s.top, s)
		}
	}
	return next
}

func describe(in interface{}, out interface{}) string {
	c, r := in.(input), out.(output)
	what := fmt.Sprintf("%s(%s %s %s tok=%d permits=%d slot=%d)", c.Op, c.Target, c.Lease, c.Owner, c.Token, c.permits(), c.Slot)
	if r == nil {
		return what + " -> ?"
	}
	return fmt.Sprintf("%s -> %s %d slot=%d %s%s%s", what, r.Outcome, r.Token+r.Newest, r.Slot, r.Owner, r.Reason, r.Kind)
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
		if c.permits() > maxSlots || c.Slot < 0 || c.Slot >= c.permits() && c.Op != "check" || c.Slot >= maxSlots {
			fmt.Fprintf(os.Stderr, "history: call %+v asks permits or a slot the model does not have (at most %d)\n", c, maxSlots)
			os.Exit(2)
		}
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
			open := func(o bool) string {
				if o {
					return "+"
				}
				return ""
			}
			text := fmt.Sprintf("top=%d%s", s.top, open(s.topOpen))
			if s.inForce != 0 {
				text += fmt.Sprintf(" permits=%d", s.inForce)
			}
			for i, sl := range s.slots {
				if sl.held {
					text += fmt.Sprintf(" [%d: %s/%s tok=%d of %d, fence=%d%s]", i, sl.h.owner, sl.h.lease, sl.h.token, sl.h.permits, sl.fence, open(sl.fenceOpen))
				} else if sl.fence != 0 || sl.fenceOpen {
					text += fmt.Sprintf(" [%d: free, fence=%d%s]", i, sl.fence, open(sl.fenceOpen))
				}
			}
			return text
		},
	}
	model := spec.ToModel()
	// LINEARIZE_TIMEOUT (a Go duration) bounds the search; two minutes unless told.
	limit := 120 * time.Second
	if v := os.Getenv("LINEARIZE_TIMEOUT"); v != "" {
		if limit, err = time.ParseDuration(v); err != nil || limit <= 0 {
			fmt.Fprintln(os.Stderr, "LINEARIZE_TIMEOUT:", v, "is not a positive duration")
			os.Exit(2)
		}
	}
	result, info := porcupine.CheckOperationsVerbose(model, ops, limit)
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
