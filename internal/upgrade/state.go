package upgrade

// state is where an Upgrader is in the life of its generation. It changes
// only in Upgrader.stepLocked, by the events below, along these edges:
//
//	following --prevDrained--> serving --grant--> granting --ready--> handedOver
//	                              ^                   |
//	                              +------fail---------+
//
// and close, from any state not closed yet: following and serving go to
// closed; granting to closingGranting, which a ready turns into
// closedHandedOver and a fail into closed; handedOver to closedHandedOver.
type state uint8

const (
	// stateFollowing: this generation took over and its predecessor still
	// drains; upgrade requests are refused as busy.
	stateFollowing state = iota
	// stateServing: the live generation; the next upgrade request is
	// granted.
	stateServing
	// stateGranting: a new process was granted the listener and sent the
	// sockets; its ready is awaited. Requests are refused as busy.
	stateGranting
	// stateHandedOver: the new process took over; this generation drains.
	// Requests are refused as busy.
	stateHandedOver
	// stateClosingGranting: Close was called while granting; the new
	// process's answer decides between closed and closedHandedOver.
	stateClosingGranting
	// stateClosed: closed while owning the sockets: Close removes their
	// files.
	stateClosed
	// stateClosedHandedOver: closed after handing over: the sockets and
	// their files are the new process's; Close fires Upgraded.
	stateClosedHandedOver
)

// event is what moves a state along an edge.
type event uint8

const (
	evPrevDrained event = iota // the previous generation closed its connection
	evGrant                    // an upgrade request is granted
	evFail                     // the granted handover failed before ready
	evReady                    // the new process sent ready
	evClose                    // the listener is being closed
)

// next returns the state that ev leads to from s, and false if ev has no
// edge from s (the state then stays s).
func (s state) next(ev event) (state, bool) {
	switch {
	case ev == evPrevDrained && s == stateFollowing:
		return stateServing, true
	case ev == evGrant && s == stateServing:
		return stateGranting, true
	case ev == evFail && s == stateGranting:
		return stateServing, true
	case ev == evFail && s == stateClosingGranting:
		return stateClosed, true
	case ev == evReady && s == stateGranting:
		return stateHandedOver, true
	case ev == evReady && s == stateClosingGranting:
		return stateClosedHandedOver, true
	case ev == evClose && (s == stateFollowing || s == stateServing):
		return stateClosed, true
	case ev == evClose && s == stateGranting:
		return stateClosingGranting, true
	case ev == evClose && s == stateHandedOver:
		return stateClosedHandedOver, true
	}
	return s, false
}

// closing reports whether Close was called.
func (s state) closing() bool { return s >= stateClosingGranting }

// refusal returns the reason to refuse an upgrade request in state s,
// refuseClosing or refuseBusy, or 0 if s grants it.
func (s state) refusal() uint64 {
	switch {
	case s.closing():
		return refuseClosing
	case s != stateServing:
		return refuseBusy
	}
	return 0
}
