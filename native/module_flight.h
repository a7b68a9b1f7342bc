/* module_flight.h -- the flight-record ring shared by the CPython binding's files (module.c's
 * Comm.allreduce_rec writes its records through these). See module_flight.c. */
#ifndef HR_MODULE_FLIGHT_H
#define HR_MODULE_FLIGHT_H

#include <Python.h>

typedef struct FlightObject FlightObject;
extern PyTypeObject FlightType;

/* A new record in state "started" (GIL held): op and dtype are str, root -1 for none, the call
 * site read from the current Python frames. Returns its sequence number. */
long long fl_begin(FlightObject *f, PyObject *op, PyObject *dtype, long long count, long root,
                   double timeout);

/* End record seq: "done" (error NULL) or "failed" with the error str. Returns 1, or 0 when
 * the slot holds another record (overwritten: nothing written). GIL held. */
int fl_end(FlightObject *f, long long seq, PyObject *error);

#endif
